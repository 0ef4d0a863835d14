"""Project-wide pytest options."""


def pytest_addoption(parser):
    parser.addoption(
        "--update-golden", action="store_true", default=False,
        help="rewrite tests/step_time/golden/*.json (refused for a key or null-pattern change "
             "at an unchanged SCHEMA_VERSION)",
    )
