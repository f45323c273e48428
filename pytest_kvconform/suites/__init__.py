"""pytest-kvconform conformance suites (run with pytest --pyargs pytest_kvconform.suites)."""
