"""Resolve the project's JVM artifacts from Maven Central into a git-ignored cache.

Each artifact set is a pom under ``backfill_assets/stack/maven/<set>/`` (package data).
Resolution copies the set's runtime jars into ``<jar_cache>/<set>/``. It is atomic per set:
jars are copied into a temporary directory that is renamed into place only after Maven
succeeds, and a stamp holding the pom's hash is written last. A set whose stamp matches its
pom is not resolved again.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from backfill_assets.errors import JarResolutionError
from backfill_assets.stack.settings import Settings

MAVEN_DIR = Path(__file__).resolve().parent / "maven"
# spark-cloud: Postgres JDBC driver and S3 (only on Spark's classpath for a Postgres catalog or
# an s3:// warehouse/archive); s3proxy: the test tier's object store, never on Spark's classpath;
# spark-formats: spark-avro and protobuf-java, for decoding schema-registry topics (in
# spark.jars: from_avro; the udf jar's ProtobufRow); kafka-connect: the CDC source's Kafka
# Connect worker with Debezium's Postgres connector (stack/cdc.py), never on Spark's classpath;
# kafka-connect-avro: Apicurio's Avro converter for that worker (beside kafka-connect, whose
# Kafka and Jackson it uses), so Debezium can write Avro through the schema registry;
# iceberg-rest: Iceberg's REST catalog server code, the test tier's REST catalog
# (backfill_assets_tests/support/iceberg_rest.py), never on Spark's classpath.
JAR_SETS = (
    "kafka-broker",
    "spark",
    "spark-cloud",
    "s3proxy",
    "spark-formats",
    "kafka-connect",
    "kafka-connect-avro",
    "iceberg-rest",
)
# Sets only a benchmark uses, resolved on its first run, never by `jars resolve`:
# iceberg-sink: Apache Iceberg's Kafka Connect sink (bench/iceberg_sink.py's peer).
BENCH_JAR_SETS = ("iceberg-sink",)
_STAMP = ".resolved-pom.sha256"


def pom_path(jar_set: str) -> Path:
    if jar_set not in JAR_SETS + BENCH_JAR_SETS:
        known = ", ".join(JAR_SETS + BENCH_JAR_SETS)
        raise JarResolutionError(f"unknown jar set {jar_set!r}; known sets: {known}")
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
    _maven_into(
        jar_dir(settings, jar_set),
        lambda staging: [
            "-f",
            str(pom_path(jar_set)),
            "dependency:copy-dependencies",
            "-DincludeScope=runtime",
            f"-DoutputDirectory={staging}",
        ],
        failure=f"Maven could not resolve jar set {jar_set!r} from {pom_path(jar_set)}",
        stamp=functools.partial(_pom_hash, jar_set),
    )
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


def _maven_into(
    target: Path,
    args: Callable[[Path], list[str]],
    *,
    failure: str,
    stamp: Callable[[], str],
    product: Path | None = None,
) -> None:
    """Run Maven (batch, quiet, the project's ``settings.xml``) with ``args(staging)``, a
    staging directory beside ``target``; on success rename it to ``target`` and write
    ``stamp()`` last, so a cache directory is whole or absent. A failed run, or one that did not
    make ``product`` (a path under the staging directory), raises :class:`JarResolutionError`
    starting with ``failure`` and leaves ``target`` as it was."""
    mvn = shutil.which("mvn")
    if mvn is None:
        raise JarResolutionError(
            "Maven (mvn) is not on PATH; install it (apt-get install maven) and run "
            "`backfill-assets jars resolve` again"
        )
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    cmd = [mvn, "-B", "-q", "-s", str(MAVEN_DIR / "settings.xml"), *args(staging)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0 or (product is not None and not (staging / product).is_file()):
        shutil.rmtree(staging, ignore_errors=True)
        errors = [line for line in proc.stdout.splitlines() if "ERROR" in line][:5]
        raise JarResolutionError(
            f"{failure}:\n"
            + "\n".join(errors or proc.stderr.splitlines()[-5:])
            + "\nCheck that Maven Central is reachable, then run `backfill-assets jars resolve`."
        )
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    (target / _STAMP).write_text(stamp() + "\n")


# The local schema registry (stack/registry.py): a Maven project under maven/schema-registry
# that Maven and Quarkus build into a runnable application, not a set of jars.
REGISTRY_PROJECT = MAVEN_DIR / "schema-registry"


def registry_dir(settings: Settings) -> Path:
    return settings.jar_cache / "schema-registry"


def registry_jar_path(settings: Settings) -> Path:
    """The registry's launcher jar (Quarkus fast-jar layout: ``quarkus-app/quarkus-run.jar``)."""
    return registry_dir(settings) / "quarkus-app" / "quarkus-run.jar"


def registry_built(settings: Settings) -> bool:
    stamp = registry_dir(settings) / _STAMP
    return (
        registry_jar_path(settings).is_file()
        and stamp.is_file()
        and stamp.read_text().strip() == _registry_hash()
    )


def build_registry(settings: Settings) -> bool:
    """Build the schema registry application into ``<jar_cache>/schema-registry`` (about 30 s
    and 130 MB, once per change of its Maven project); True if Maven ran. Atomic like
    :func:`resolve`: built in a temporary directory renamed into place, stamp written last."""
    if registry_built(settings):
        return False
    _maven_into(
        registry_dir(settings),
        lambda staging: [
            "-f",
            str(REGISTRY_PROJECT / "pom.xml"),
            f"-Dregistry.build.dir={staging}",
            "-DskipTests",
            "package",
        ],
        failure=f"Maven could not build the schema registry from {REGISTRY_PROJECT}",
        stamp=_registry_hash,
        product=Path("quarkus-app") / "quarkus-run.jar",
    )
    return True


def _registry_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in REGISTRY_PROJECT.rglob("*") if p.is_file()):
        if "target" in path.relative_to(REGISTRY_PROJECT).parts:
            continue
        digest.update(path.relative_to(REGISTRY_PROJECT).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


JAVA_SOURCES = Path(__file__).parent / "java"


def udf_jar_path(settings: Settings) -> Path:
    """Where :func:`udf_jar` keeps the jar for these sources and this pyspark."""
    import pyspark

    digest = hashlib.sha256(pyspark.__version__.encode())
    digest.update(_pom_hash("spark-formats").encode())  # compiled against protobuf-java
    for src in sorted(JAVA_SOURCES.rglob("*.java")):
        digest.update(src.relative_to(JAVA_SOURCES).as_posix().encode())
        digest.update(src.read_bytes())
    return settings.jar_cache / "udf" / f"backfill-udf-{digest.hexdigest()[:16]}.jar"


def udf_jar(settings: Settings) -> Path:
    """The project's own JVM functions (``stack/java``: the raw parse's strict JSON reader, the
    protobuf decode), compiled against this pyspark's jars and the ``spark-formats`` set into
    ``<jar_cache>/udf/``; built on first use.

    The jar is named by the hash of its sources and of pyspark's version, so a change to either
    builds a new one. It is written to a temporary name and renamed into place (atomic). Needs a
    JDK (``javac``) where the Spark driver runs; the driver ships the jar to executors
    (``spark.jars``)."""
    import pyspark

    target = udf_jar_path(settings)
    if target.is_file():
        return target
    javac = shutil.which("javac")
    if javac is None:
        raise JarResolutionError(
            "javac is not on PATH: the Spark driver needs a JDK 17 to build the project's JVM "
            "functions (apt-get install openjdk-17-jdk-headless), then run "
            "`backfill-assets jars resolve` again"
        )
    import tempfile
    import zipfile

    sources = sorted(JAVA_SOURCES.rglob("*.java"))
    target.parent.mkdir(parents=True, exist_ok=True)
    spark_jars = Path(pyspark.__file__).parent / "jars"
    classpath = os.pathsep.join([f"{spark_jars}/*", *map(str, jars(settings, "spark-formats"))])
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        classes = Path(tmp) / "classes"
        cmd = [
            javac,
            "--release",
            "17",
            "-nowarn",
            "-cp",
            classpath,
            "-d",
            str(classes),
            *map(str, sources),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise JarResolutionError(
                f"javac could not build the project's JVM functions from {JAVA_SOURCES}:\n"
                + "\n".join((proc.stderr or proc.stdout).splitlines()[:10])
            )
        staging = Path(tmp) / target.name
        with zipfile.ZipFile(staging, "w", zipfile.ZIP_DEFLATED) as jar:
            for cls in sorted(classes.rglob("*.class")):
                jar.write(cls, cls.relative_to(classes).as_posix())
        staging.replace(target)
    return target
