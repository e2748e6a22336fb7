"""lm-eval against the server: a multiple-choice task from a local file, scored through
``local-completions`` (echo + logprobs, as lm-eval's loglikelihood requests go) and through
lm-eval's own transformers backend on the same checkpoint in fp32; every loglikelihood must agree.

    pip install lm-eval            # not in the test extra: too heavy for CI
    python scripts/lm_eval_check.py --model checkpoints/tiny-llama

Prints both accuracies, the largest loglikelihood difference, and exits 1 past ``--tol``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from local_server import serving

QUESTIONS = [
    ("The capital of France is", [" Paris", " Rome", " Berlin", " Madrid"], 0),
    ("Water freezes at zero degrees", [" Celsius", " Kelvin", " Fahrenheit", " Rankine"], 0),
    ("The largest planet in the solar system is", [" Jupiter", " Mars", " Venus", " Mercury"], 0),
    ("A week has", [" seven days", " five days", " ten days", " three days"], 0),
    ("The opposite of hot is", [" cold", " warm", " loud", " tall"], 0),
    ("Python lists are created with", [" square brackets", " angle brackets", " quotes", " colons"], 0),
    ("The sun rises in the", [" east", " west", " north", " south"], 0),
    ("Two plus two equals", [" four", " five", " three", " six"], 0),
]
TASK = """task: minisgl_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def evaluate(model: str, model_args: str, include: Path) -> tuple[float, list[list[float]]]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["minisgl_mc"],
        log_samples=True,
        task_manager=TaskManager(include_path=str(include)),
    )
    samples = sorted(out["samples"]["minisgl_mc"], key=lambda s: s["doc_id"])
    return out["results"]["minisgl_mc"]["acc,none"], [[r[0][0] for r in s["resps"]] for s in samples]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint folder with a tokenizer")
    ap.add_argument("--tol", type=float, default=1e-4)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp())
    data = work / "mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (work / "minisgl_mc.yaml").write_text(TASK.format(data=data))
    with serving(args.model, "--dtype", "float32", "--served-model-name", "m") as url:
        served = evaluate(
            "local-completions",
            f"base_url={url}/v1/completions,model=m,tokenizer={args.model},tokenized_requests=True,num_concurrent=4",
            work,
        )
    reference = evaluate("hf", f"pretrained={args.model},dtype=float32,device=cpu", work)
    diff = max(abs(a - b) for x, y in zip(served[1], reference[1]) for a, b in zip(x, y))
    print(
        json.dumps(
            {
                "accuracy_server": served[0],
                "accuracy_transformers": reference[0],
                "max_loglikelihood_diff": diff,
                "questions": len(QUESTIONS),
            }
        )
    )
    return 0 if diff <= args.tol and served[0] == reference[0] else 1


if __name__ == "__main__":
    sys.exit(main())
