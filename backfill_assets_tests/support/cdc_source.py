"""The CDC source the ``cdc`` tier's modules share (one per session, the ``cdc_source``
fixture): Debian's Postgres with logical decoding in a temporary directory the ``postgres``
user can enter, and a Kafka Connect worker under the session's BACKFILL_HOME, both on free
ports, stopped by PID at the end of the session (``test_cdc_stack`` checks that, last).

The worker's classpath also holds the test clock (``java/backfill_assets_tests/TestClock.java``,
compiled here): a producer interceptor a connector opts into with :func:`clock_overrides`, whose
records are stamped with the worker's time plus the milliseconds in a file the test writes
(:class:`Clock`). A Kafka-time hour can be backfilled only once it has ended; the lake's tests
put each phase's changes in an hour of the past instead of waiting an hour per phase.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from backfill_assets.stack import jars
from backfill_assets.stack.cdc import CdcSource
from backfill_assets.stack.postgres import PgServer
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.services import free_port

# The clock's own source only: the folder also holds other test servers' sources, compiled
# against other classpaths (iceberg_rest.py).
CLOCK_SOURCE = Path(__file__).parent / "java" / "backfill_assets_tests" / "TestClock.java"
CLOCK_CLASS = "backfill_assets_tests.TestClock"


@dataclass
class SharedCdc:
    source: CdcSource
    server: PgServer


def clock_jar(settings: Settings, target: Path) -> Path:
    """The test clock compiled against the worker's Kafka clients into ``target``."""
    javac = shutil.which("javac")
    assert javac is not None, "the cdc tier needs a JDK (javac)"
    classpath = ":".join(map(str, jars.jars(settings, "kafka-connect")))
    with tempfile.TemporaryDirectory() as tmp:
        classes = Path(tmp)
        subprocess.run(
            [javac, "--release", "17", "-nowarn", "-cp", classpath, "-d", str(classes),
             str(CLOCK_SOURCE)],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        with zipfile.ZipFile(target, "w") as jar:
            for cls in sorted(classes.rglob("*.class")):
                jar.write(cls, cls.relative_to(classes).as_posix())
    return target


def running(settings: Settings) -> Iterator[SharedCdc]:
    """Start the shared source; stop it (by PID) and remove its Postgres at the end."""
    root = Path(tempfile.mkdtemp(prefix="backfill-cdc-pg-"))
    jar = clock_jar(settings, settings.home / "backfill-test-clock.jar")
    source = CdcSource(
        settings,
        postgres_root=root,
        postgres_port=free_port(),
        connect_port=free_port(),
        worker_classpath=[jar],
    )
    try:
        server, _ = source.start()
        yield SharedCdc(source, server)
    finally:
        source.stop()
        shutil.rmtree(root, ignore_errors=True)


class Clock:
    """The test clock of the connectors that opt in (:func:`clock_overrides`): a file holding
    the milliseconds added to the worker's time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.shift_ms(0)

    def shift_ms(self, ms: int) -> None:
        staging = self.path.with_suffix(".tmp")
        staging.write_text(f"{ms}\n")
        staging.replace(self.path)  # the interceptor never reads half a number

    def at(self, moment: datetime) -> None:
        """From now on, records are stamped as if now were ``moment``."""
        self.shift_ms(int((moment - datetime.now(moment.tzinfo)).total_seconds() * 1000))

    def overrides(self) -> dict[str, str]:
        return clock_overrides(self.path)


def clock_overrides(path: Path) -> dict[str, str]:
    """A connector's settings that stamp its records with the test clock in ``path``."""
    return {
        "producer.override.interceptor.classes": CLOCK_CLASS,
        "producer.override.backfill.test.clock.file": str(path),
    }
