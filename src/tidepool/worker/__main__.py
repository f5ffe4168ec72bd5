"""``python -m tidepool.worker ADDRESS`` (the same as ``tidepool worker ADDRESS``)."""

from tidepool.cli import main

if __name__ == "__main__":
    import sys

    raise SystemExit(main(["worker", *sys.argv[1:]]))
