"""SGLang's frontend language (``RuntimeEndpoint``: gen, select, streaming) against the server.

    pip install --no-deps sglang pybase64 pillow   # the frontend only; not in the test extra
    python scripts/sglang_frontend_check.py --model checkpoints/tiny-llama

Runs a program with gen and select, once whole and once streamed, and checks that the two
agree and that select picked one of its choices; exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "minisgl.launch", "--model", args.model, "--port", str(port),
                               "--device", "cpu", "--log-level", "warning"])
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(1)
        sgl.set_default_backend(sgl.RuntimeEndpoint(f"http://127.0.0.1:{port}"))
        whole = program.run(question="What is two plus two?")
        streamed = program.run(question="What is two plus two?", stream=True)
        pieces = list(streamed.text_iter())
        report = {"answer": whole["answer"], "verdict": whole["verdict"], "streamed_pieces": len(pieces),
                  "same_text": whole.text() == streamed.text()}
    finally:
        server.terminate()
        server.wait(30)
    print(json.dumps(report))
    return 0 if report["verdict"] in (" yes", " no", " maybe") and report["same_text"] else 1


if __name__ == "__main__":
    sys.exit(main())
