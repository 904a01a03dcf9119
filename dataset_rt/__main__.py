"""``python -m dataset_rt``: the ``dataset-rt`` command line."""

from dataset_rt.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
