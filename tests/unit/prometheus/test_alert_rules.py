"""config/prometheus/alerts.yaml: valid rules, and each alert fires on the series written for it
and stays quiet on its neighbours (`promtool test rules`, alerts_test.yaml beside this file)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from tests.harness.prometheus import alerts, write_rule_file
from tests.harness.requirements import require

CASES = Path(__file__).with_name("alerts_test.yaml")


def promtool() -> str:
    path = shutil.which("promtool")
    require([] if path else ["promtool (Debian package prometheus)"])
    assert path is not None
    return path


def test_the_rules_pass_promtool_check_and_their_unit_tests(tmp_path: Path) -> None:
    tool = promtool()
    rules = write_rule_file(tmp_path / "rules.yaml")
    shutil.copy(CASES, tmp_path / CASES.name)
    checked = subprocess.run([tool, "check", "rules", str(rules)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in checked.stdout
    tested = subprocess.run(
        [tool, "test", "rules", CASES.name], cwd=tmp_path, capture_output=True, text=True
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_has_a_case_that_fires_it() -> None:
    fired = {
        check["alertname"]
        for case in yaml.safe_load(CASES.read_text())["tests"]
        for check in case["alert_rule_test"]
        if check.get("exp_alerts")
    }
    assert fired == set(alerts())
    assert set(alerts()) >= {
        "CnsSubnetNearlyFull",
        "CnsAddsWaiting",
        "CnsDuplicateAddresses",
        "CnsLeaksReclaimedRising",
        "CnsNoControllerLeader",
        "CnsDaemonNotReady",
    }
