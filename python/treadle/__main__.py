"""``python -m treadle`` (and ``torchrun ... -m treadle``): the ``treadle`` command."""
from treadle.cli import main

if __name__ == "__main__":
    main()
