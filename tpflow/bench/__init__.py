"""The benchmark harness: ``python -m tpflow.bench`` (see ``__main__``)."""
