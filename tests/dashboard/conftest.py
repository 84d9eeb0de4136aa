from tests.rl.conftest import model_dir  # noqa: F401  (the tiny model the end-to-end runs share)
