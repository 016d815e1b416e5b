from tests.loadgen.fixtures import fake_url, virtual  # noqa: F401  (fixtures)
