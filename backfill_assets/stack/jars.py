"""Resolve the project's JVM artifacts from Maven Central into a git-ignored cache.

Each artifact set is a pom under ``infra/maven/<set>/``. Resolution copies the set's runtime
jars into ``<jar_cache>/<set>/``. It is atomic per set: jars are copied into a temporary
directory that is renamed into place only after Maven succeeds, and a stamp holding the pom's
hash is written last. A set whose stamp matches its pom is not resolved again.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

from backfill_assets.errors import JarResolutionError
from backfill_assets.stack.settings import REPO_ROOT, Settings

MAVEN_DIR = REPO_ROOT / "infra" / "maven"
JAR_SETS = ("kafka-broker", "spark")
_STAMP = ".resolved-pom.sha256"


def pom_path(jar_set: str) -> Path:
    if jar_set not in JAR_SETS:
        raise JarResolutionError(f"unknown jar set {jar_set!r}; known sets: {', '.join(JAR_SETS)}")
    return MAVEN_DIR / jar_set / "pom.xml"


def jar_dir(settings: Settings, jar_set: str) -> Path:
    pom_path(jar_set)
    return settings.jar_cache / jar_set


def is_resolved(settings: Settings, jar_set: str) -> bool:
    stamp = jar_dir(settings, jar_set) / _STAMP
    return stamp.is_file() and stamp.read_text().strip() == _pom_hash(jar_set)


def resolve(settings: Settings, jar_set: str) -> bool:
    """Resolve one set; return True if Maven ran, False if the cache was already current."""
    if is_resolved(settings, jar_set):
        return False
    mvn = shutil.which("mvn")
    if mvn is None:
        raise JarResolutionError(
            "Maven (mvn) is not on PATH; install it (apt-get install maven) and run "
            "`backfill-assets jars resolve` again"
        )
    target = jar_dir(settings, jar_set)
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    cmd = [
        mvn,
        "-B",
        "-q",
        "-s",
        str(MAVEN_DIR / "settings.xml"),
        "-f",
        str(pom_path(jar_set)),
        "dependency:copy-dependencies",
        "-DincludeScope=runtime",
        f"-DoutputDirectory={staging}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        errors = [line for line in proc.stdout.splitlines() if "ERROR" in line][:5]
        raise JarResolutionError(
            f"Maven could not resolve jar set {jar_set!r} from {pom_path(jar_set)}:\n"
            + "\n".join(errors or proc.stderr.splitlines()[-5:])
            + "\nCheck that Maven Central is reachable, then run `backfill-assets jars resolve`."
        )
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    (target / _STAMP).write_text(_pom_hash(jar_set) + "\n")
    return True


def resolve_all(settings: Settings) -> dict[str, bool]:
    return {jar_set: resolve(settings, jar_set) for jar_set in JAR_SETS}


def jars(settings: Settings, jar_set: str) -> list[Path]:
    """The resolved jars of a set; a clear error if the set has not been resolved."""
    if not is_resolved(settings, jar_set):
        raise JarResolutionError(
            f"jar set {jar_set!r} is not resolved in {jar_dir(settings, jar_set)} "
            "(or its pom changed since); run `backfill-assets jars resolve`"
        )
    return sorted(jar_dir(settings, jar_set).glob("*.jar"))


def _pom_hash(jar_set: str) -> str:
    return hashlib.sha256(pom_path(jar_set).read_bytes()).hexdigest()
