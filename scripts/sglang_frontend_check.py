"""SGLang's frontend language (``RuntimeEndpoint``: gen, select, streaming) against the server.

    pip install --no-deps sglang pybase64 pillow   # the frontend only; not in the test extra
    python scripts/sglang_frontend_check.py --model checkpoints/tiny-llama

Runs a program with gen and select, once whole and once streamed, and checks that the two
agree and that select picked one of its choices; exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys

from local_server import serving


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    args = ap.parse_args()
    import sglang as sgl

    @sgl.function
    def program(s, question):
        s += "Q: " + question + "\nA:"
        s += sgl.gen("answer", max_tokens=8, temperature=0)
        s += "\nIs that right?" + sgl.select("verdict", choices=[" yes", " no", " maybe"])

    with serving(args.model) as url:
        sgl.set_default_backend(sgl.RuntimeEndpoint(url))
        whole = program.run(question="What is two plus two?")
        streamed = program.run(question="What is two plus two?", stream=True)
        pieces = list(streamed.text_iter())
        report = {
            "answer": whole["answer"],
            "verdict": whole["verdict"],
            "streamed_pieces": len(pieces),
            "same_text": whole.text() == streamed.text(),
        }
    print(json.dumps(report))
    return 0 if report["verdict"] in (" yes", " no", " maybe") and report["same_text"] else 1


if __name__ == "__main__":
    sys.exit(main())
