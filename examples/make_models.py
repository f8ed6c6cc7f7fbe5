"""Write the example models of parastream's zoo to examples/models/*.onnx.

    python examples/make_models.py [FOLDER]

The files are generated from a fixed seed, so running this again gives the same bytes (tests/pipeline/test_zoo.py
checks that the committed files equal freshly generated ones).
"""

from __future__ import annotations

import sys
from pathlib import Path

from parastream.pipeline.zoo import write_all


def main(argv: list[str]) -> int:
    folder = Path(argv[0]) if argv else Path(__file__).resolve().parent / "models"
    for path in write_all(folder):
        print(f"{path}  {path.stat().st_size / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
