"""Maps the top-level folders onto the one `traceml` import namespace (ARCHITECTURE.md section 3)."""
from setuptools import find_packages, setup

PACKAGE_ROOTS = {
    "traceml": "instrumentation",
    "traceml.exporter": "exporter",
    "traceml.processor": "processor",
    "traceml.schema": "schema",
    "traceml.launcher": "launcher",
}

packages = []
for package, folder in PACKAGE_ROOTS.items():
    packages.append(package)
    packages.extend(f"{package}.{sub}" for sub in find_packages(folder))

setup(packages=packages, package_dir=PACKAGE_ROOTS)
