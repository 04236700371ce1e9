"""Spark settings that hold secrets stay off the driver JVM's command line.

pyspark starts the driver JVM as ``spark-submit --conf KEY=VALUE ...``, readable by every user
of the machine in ``ps``. A new classic session is started in a child Python process (its own
JVM, so the test session's shared one is untouched) with a catalog header, an archive-style
Hadoop key and an arbitrary ``spark.*`` token set; the JVM's command line must hold none of
them while the session still has each one, and the 0600 file that carried them is gone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from backfill_assets.stack.settings import REPO_ROOT

pytestmark = pytest.mark.cluster

SECRETS = {
    "header": "Bearer hdr-5ecret-7f3a",
    "hadoop": "s3a-5ecret-91bc",
    "token": "tok-5ecret-02de",
}

_CHILD = """
import json, os, sys
from pathlib import Path
from backfill_assets.stack import spark
from backfill_assets.stack.settings import Settings

session = spark.get_session(Settings.from_env())
me = str(os.getpid())
jvms = [p for p in Path("/proc").glob("[0-9]*")
        if (p / "stat").exists() and (p / "stat").read_text().rsplit(")", 1)[1].split()[1] == me]
conf = session.sparkContext.getConf()
session.sql("SHOW NAMESPACES IN lake").collect()  # the catalog works with its header
print(json.dumps({
    "cmdlines": [(p / "cmdline").read_bytes().replace(b"\\0", b" ").decode() for p in jvms],
    "header": session.conf.get("spark.sql.catalog.lake.header.Authorization"),
    "hadoop": session.sparkContext._jsc.hadoopConfiguration().get("fs.s3a.secret.key"),
    "token": conf.get("spark.backfill.test.token"),
    "submit_args": os.environ.get("PYSPARK_SUBMIT_ARGS"),
}))
session.stop()
"""


def test_secret_spark_settings_reach_the_session_but_not_the_command_line(
    tmp_path: Path,
) -> None:
    files_before = set(Path(tempfile.gettempdir()).glob("backfill-spark-*"))
    env = {
        **os.environ,
        "BACKFILL_HOME": str(tmp_path),
        "BACKFILL_JAR_CACHE": os.environ.get(
            "BACKFILL_JAR_CACHE", str(REPO_ROOT / ".stack" / "jars")
        ),
        "BACKFILL_CATALOG_PROPERTIES": json.dumps({"header.Authorization": SECRETS["header"]}),
        "BACKFILL_SPARK_CONF": json.dumps(
            {
                "spark.hadoop.fs.s3a.secret.key": SECRETS["hadoop"],
                "spark.backfill.test.token": SECRETS["token"],
            }
        ),
    }
    env.pop("PYSPARK_SUBMIT_ARGS", None)
    env.pop("BACKFILL_SPARK_CONNECT", None)
    done = subprocess.run(
        [sys.executable, "-c", _CHILD],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["cmdlines"] and any("SparkSubmit" in c for c in seen["cmdlines"]), seen
    for name, secret in SECRETS.items():
        for cmdline in seen["cmdlines"]:
            assert secret not in cmdline, (name, cmdline)
    assert {name: seen[name] for name in SECRETS} == SECRETS
    assert seen["submit_args"] is None  # restored after the start
    assert set(Path(tempfile.gettempdir()).glob("backfill-spark-*")) == files_before
