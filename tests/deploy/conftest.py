"""tests/deploy: helpers are imported by their full names (`tests.deploy.deploy_files`)."""
