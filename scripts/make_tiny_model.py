"""Write a tiny random checkpoint (``minisgl.device.tiny_model``):

python scripts/make_tiny_model.py --arch llama --out checkpoints/tiny-llama
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's minisgl, installed or not

from minisgl.device.tiny_model import main

if __name__ == "__main__":
    main()
