"""Benchmarks: what advisory-locks costs against the raw driver, measured in one run.

Run ``python -m benchmarks.run --help``; see ``benchmarks/README.md``.
"""
