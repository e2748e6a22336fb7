"""Write a tiny random checkpoint (``minisgl.tiny_model``):

python scripts/make_tiny_model.py --arch llama --out checkpoints/tiny-llama
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's minisgl, installed or not

from minisgl.tiny_model import main  # noqa: E402

if __name__ == "__main__":
    main()
