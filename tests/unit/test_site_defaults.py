"""Site and user defaults files layered under the spec, and `validate --explain`.

Order, lowest first: built-in < site file < user file < spec < --set. No SLURM needed.
"""

import json

import pytest

from conftest import write
from orchestrator import contract
from orchestrator.cli.main import main
from orchestrator.errors import SpecError, UserError
from orchestrator.ledger import Ledger
from orchestrator.spec import defaults
from orchestrator.spec.layers import Layer, layered
from orchestrator.submit import submission

SITE = (
    "# the site's defaults\n"  # 1
    "resources:\n"  # 2
    "  partition: gpu\n"  # 3
    "  account: site-acct\n"  # 4
    "  qos: normal\n"  # 5
    "  setup: ['module load cuda']\n"  # 6
    "  sbatch_extra: {mail-type: END}\n"  # 7
    "checkpoint:\n"  # 8
    "  signal_before_s: 300\n"  # 9
    "retry:\n"  # 10
    "  max_requeues: 7\n"  # 11
    "env:\n"  # 12
    "  HF_HUB_OFFLINE: '1'\n"  # 13
)
USER = (
    "resources:\n"  # 1
    "  account: my-acct\n"  # 2
    "  sbatch_extra: {mail-user: me@example.org}\n"  # 3
    "heartbeat:\n"  # 4
    "  startup_timeout_s: 1200\n"  # 5
)
SPEC = (
    "name: layered\n"  # 1
    "steps: 10\n"  # 2
    "resources:\n"  # 3
    "  qos: high\n"  # 4
    "  setup: ['module load python']\n"  # 5
)


@pytest.fixture
def files(tmp_path, monkeypatch):
    """A site file (ORCHESTRATE_SITE), a user file in the home, and a spec."""
    home = tmp_path / "home"
    home.mkdir()
    site = write(tmp_path / "site.yaml", SITE)
    user = write(home / "defaults.yaml", USER)
    spec = write(tmp_path / "exp.yaml", SPEC)
    monkeypatch.setenv("ORCHESTRATE_SITE", str(site))
    monkeypatch.setenv("ORCHESTRATE_HOME", str(tmp_path / "elsewhere"))  # --home wins
    monkeypatch.setenv("COLUMNS", "300")  # table rows on one line each
    return home, site, user, spec


def plan_of(spec, home, overrides=()):
    return submission.make_plan(str(spec), list(overrides), "local", home)


def test_layers_in_order_mappings_merge_lists_and_scalars_replace(files):
    home, _, _, spec = files
    s = plan_of(spec, home, ["retry.max_requeues=2"]).spec
    r = s.resources
    assert r.partition == "gpu"  # site only
    assert r.account == "my-acct"  # user over site
    assert r.qos == "high"  # spec over both
    assert r.setup == ["module load python"]  # a list replaces, never appends
    assert r.sbatch_extra == {"mail-type": "END", "mail-user": "me@example.org"}  # a mapping merges
    assert s.checkpoint.signal_before_s == 300 and s.heartbeat.startup_timeout_s == 1200
    assert s.retry.max_requeues == 2  # --set over the site
    assert s.env == {"HF_HUB_OFFLINE": "1"}
    assert r.nodes == 1 and s.checkpoint.signal == "USR2"  # built-in defaults stay


def test_spec_null_drops_a_site_value(files):
    home, _, _, spec = files
    write(spec, SPEC + "  partition: null\n")
    assert plan_of(spec, home).spec.resources.partition is None


def test_validate_explain_names_each_source_and_line(files, capsys):
    home, site, user, spec = files
    rc = main(["--home", str(home), "validate", str(spec), "--explain", "--set", "resources.account=cli-acct"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 2}
    expect = {
        "resources.partition": ("site", f"{site}:3"),
        "resources.account": ("--set", "--set resources.account=cli-acct"),
        "resources.qos": ("spec", f"{spec}:4"),
        "resources.setup": ("spec", f"{spec}:5"),
        "resources.sbatch_extra.mail-type": ("site", f"{site}:7"),
        "resources.sbatch_extra.mail-user": ("user", f"{user}:3"),
        "checkpoint.signal_before_s": ("site", f"{site}:9"),
        "heartbeat.startup_timeout_s": ("user", f"{user}:5"),
        "env.HF_HUB_OFFLINE": ("site", f"{site}:13"),
        "name": ("spec", f"{spec}:1"),
    }
    for field, (layer, where) in expect.items():
        cells = [c.strip() for c in rows[field].split("│")]
        assert cells[3:5] == [layer, where], rows[field]
    assert "resources.nodes" not in rows  # a built-in default is not listed


def test_submit_stores_the_layered_spec_and_its_sources(files, tmp_path):
    home, site, user, spec = files
    write(spec, SPEC + f"workdir: {tmp_path / 'runs'}\n")
    plan = plan_of(spec, home)

    class Fake:  # the scheduler's part is not what this test is about
        name = "fake"

        def submit(self, plan, watched=False):
            return {0: "1"}

    ledger = Ledger.open(tmp_path / "ledger.db")
    submission.submit(ledger, plan, Fake())
    write(site, SITE.replace("partition: gpu", "partition: cpu"))  # a later change of the site file
    (exp,) = ledger.find_experiments(plan.experiment_id)
    assert json.loads(exp["spec"])["resources"]["partition"] == "gpu"
    assert "partition: gpu" in (plan.run_dir / contract.SPEC_RESOLVED).read_text()
    sources = json.loads((plan.run_dir / contract.SPEC_SOURCES).read_text())
    assert [(f["layer"], f["file"]) for f in sources["layers"]] == [("site", str(site)), ("user", str(user))]
    assert all(len(f["sha256"]) == 64 for f in sources["layers"])
    row = next(r for r in sources["values"] if r["field"] == "resources.partition")
    assert row == {"field": "resources.partition", "value": "gpu", "layer": "site", "file": str(site), "line": 3}


def test_a_key_a_site_does_not_decide_is_refused_with_file_line_and_allowed_keys(files, capsys):
    home, site, _, spec = files
    write(site, "resources:\n  partition: gpu\n  nodes: 4\nsteps: 3\n")
    with pytest.raises(SpecError) as exc:
        plan_of(spec, home)
    issues = {i.path: i for i in exc.value.issues}
    assert issues["resources.nodes"].source == str(site) and issues["resources.nodes"].line == 3
    assert "not allowed in a defaults file" in issues["resources.nodes"].message
    assert "partition, account, qos" in issues["resources.nodes"].message
    assert issues["steps"].line == 4 and "resources, checkpoint, heartbeat, retry, env" in issues["steps"].message
    # the command: exit 2, every problem named, no traceback
    assert main(["--home", str(home), "validate", str(spec)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: 2 errors in the site defaults file") and f"{site}:3: resources.nodes:" in err


def test_a_bad_value_is_checked_as_in_a_spec_and_named_at_its_line(files):
    home, site, user, spec = files
    write(site, "resources:\n  partition: 'gpu;reboot'\nretry:\n  max_requeues: -1\n")
    with pytest.raises(SpecError) as exc:
        plan_of(spec, home)
    assert [(i.source, i.line, i.path) for i in exc.value.issues] == [
        (str(site), 2, "resources.partition"),
        (str(site), 4, "retry.max_requeues"),
    ]
    write(site, "")  # an empty site file sets nothing
    write(user, "heartbeat:\n  timeout_s: true\n")
    with pytest.raises(SpecError) as exc:
        plan_of(spec, home)
    ((source, line, path),) = [(i.source, i.line, i.path) for i in exc.value.issues]
    assert (source, line, path) == (str(user), 2, "heartbeat.timeout_s")


def test_a_check_across_fields_blames_the_defaults_line(files):
    home, site, _, spec = files
    write(site, "checkpoint:\n  signal_before_s: 7200\n")  # not below the spec's 1 h time limit
    with pytest.raises(SpecError) as exc:
        plan_of(spec, home)
    (issue,) = exc.value.issues
    assert (issue.source, issue.line, issue.path) == (str(site), 2, "checkpoint.signal_before_s")
    assert "a site default" in issue.message
    write(spec, SPEC + "  time: '04:00:00'\n")  # fine with a longer limit
    assert plan_of(spec, home).spec.checkpoint.signal_before_s == 7200


def test_malformed_or_unreadable_files_are_clear_errors(files, tmp_path):
    home, site, user, spec = files
    write(site, "resources: [\n")
    with pytest.raises(SpecError) as exc:
        plan_of(spec, home)
    assert "site defaults file" in str(exc.value) and exc.value.issues[0].source == str(site)
    write(site, "- partition: gpu\n")
    with pytest.raises(SpecError, match="a defaults file is a mapping"):
        plan_of(spec, home)
    write(site, "resources:\n  # partition: gpu\n")  # a section left empty sets nothing
    user.unlink()
    user.mkdir()  # a folder where the user file should be
    with pytest.raises(UserError, match="cannot read user defaults file"):
        plan_of(spec, home)


def test_site_variable_to_a_missing_file_is_an_error_the_default_path_is_not(files, tmp_path, monkeypatch):
    home, _, _, spec = files
    monkeypatch.setenv("ORCHESTRATE_SITE", str(tmp_path / "typo.yaml"))
    with pytest.raises(UserError, match="site defaults file '.*typo.yaml' does not exist"):
        plan_of(spec, home)
    monkeypatch.delenv("ORCHESTRATE_SITE")
    monkeypatch.setattr(defaults, "SITE_FILE", tmp_path / "etc" / "defaults.yaml")  # never the real /etc
    assert plan_of(spec, home).spec.resources.partition is None
    (tmp_path / "etc").mkdir()
    write(tmp_path / "etc" / "defaults.yaml", "resources: {partition: etc}\n")
    assert plan_of(spec, home).spec.resources.partition == "etc"
    monkeypatch.setenv("ORCHESTRATE_SITE", "")  # empty: no site file at all
    assert plan_of(spec, home).spec.resources.partition is None


def test_a_sweep_over_a_defaulted_field(files):
    home, _, _, spec = files
    write(spec, SPEC + "sweep:\n  grid:\n    retry.max_requeues: [1, 2]\n    env.HF_HUB_OFFLINE: ['0']\n")
    tasks = plan_of(spec, home).tasks
    assert [t.spec.retry.max_requeues for t in tasks] == [1, 2]
    assert {t.spec.env["HF_HUB_OFFLINE"] for t in tasks} == {"0"}
    assert all(t.spec.resources.partition == "gpu" for t in tasks)


def test_layered_is_pure_and_records_only_what_survives():
    site = Layer("site", "s.yaml", {"resources": {"partition": "a", "setup": ["x", "y"]}},
                 {("resources",): 1, ("resources", "partition"): 2, ("resources", "setup"): 3,
                  ("resources", "setup", 0): 3, ("resources", "setup", 1): 3})
    user = Layer("user", "u.yaml", {"resources": {"setup": ["z"]}}, {("resources",): 1, ("resources", "setup"): 2,
                                                                        ("resources", "setup", 0): 2})
    spec = {"name": "n", "resources": {"partition": None}}
    merged, origins = layered([site, user], spec)
    assert merged == {"resources": {"partition": None, "setup": ["z"]}, "name": "n"}
    assert origins == {("resources", "setup"): ("user", "u.yaml", 2), ("resources", "setup", 0): ("user", "u.yaml", 2)}
    assert site.data == {"resources": {"partition": "a", "setup": ["x", "y"]}} and spec == {"name": "n", "resources": {"partition": None}}
