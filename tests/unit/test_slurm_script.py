"""The batch script and sbatch parameters: pure functions of the plan, pinned by
golden files (regenerate with UPDATE_GOLDEN=1 after a deliberate change)."""

import os
from pathlib import Path

import pytest

from conftest import REPO, write
from orchestrator.errors import SpecError
from orchestrator.scheduler.slurm_script import batch_parameters, explain_refusal, render_batch_script
from orchestrator.submit.submission import make_plan

GOLDEN = Path(__file__).parents[1] / "data" / "golden"

GPU_SPEC = """\
name: gpu-ft
steps: 1000
engine: {kind: ddp, backend: nccl}
resources:
  nodes: 2
  tasks_per_node: 4
  cpus_per_task: 8
  gpus_per_task: 1
  mem: 240G
  time: "1-12:00:00"
  partition: gpu
  account: proj42
  qos: normal
  constraint: a100
  exclude: [g001, g007]
  setup_templates: [nccl, offline]
  setup:
    - module load cuda/12.4
    - source /opt/venvs/ft/bin/activate
  srun_args: ["--container-image=/images/pytorch.sqsh", "--container-mounts=/scratch:/scratch"]
  sbatch_extra: {mail-type: END, exclusive: true, hint: false}
"""


def plan_of(tmp_path, text, *overrides):
    spec = write(tmp_path / "spec.yaml", text)
    plan = make_plan(str(spec), list(overrides), "slurm", tmp_path)
    # a fixed id and folder, so the script is the same on every machine
    return plan.__class__(**{**plan.__dict__, "experiment_id": "0123abcd", "run_dir": Path("/scratch/runs") / f"{plan.name}-0123abcd"})


def check_golden(name, text):
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; UPDATE_GOLDEN=1 regenerates it if that was meant"


def test_single_task_gpu_script(tmp_path):
    check_golden("gpu_single_task.sbatch", render_batch_script(plan_of(tmp_path, GPU_SPEC), python="python3"))


def test_sweep_is_one_throttled_array(tmp_path):
    plan = plan_of(tmp_path, (REPO / "configs" / "sweep.yaml").read_text())
    script = render_batch_script(plan, python="python3")
    check_golden("sweep_array.sbatch", script)
    assert "#SBATCH --array=0-3%2" in script


def test_request_is_per_node_for_one_agent_per_node(tmp_path):
    p = batch_parameters(plan_of(tmp_path, GPU_SPEC))
    assert (p["nodes"], p["ntasks_per_node"], p["cpus_per_task"], p["gpus_per_node"]) == (2, 1, 32, 4)
    assert p["time"] == 36 * 60 and p["additional_parameters"] == {"requeue": True, "mem": "245760M", "mail-type": "END", "exclusive": True}
    assert p["exclude"] == "g001,g007" and p["srun_args"][0] == "--kill-on-bad-exit=1"


def test_notify_email_is_slurms_own_mail_on_the_array(tmp_path):
    spec = "name: mailed\nsteps: 10\nnotify:\n  email: me@example.org\n  webhook_env: SLACK_WEBHOOK_URL\n"
    script = render_batch_script(plan_of(tmp_path, spec), python="python3")
    # `on` defaults to all four; SLURM has no word for needs_attention
    assert "#SBATCH --mail-user=me@example.org" in script.splitlines()
    assert "#SBATCH --mail-type=FAIL,REQUEUE,END" in script.splitlines()
    p = batch_parameters(plan_of(tmp_path, spec.replace("  webhook_env", "  on: [completed]\n  webhook_env")))
    assert p["additional_parameters"] == {"requeue": True, "mail-user": "me@example.org", "mail-type": "END"}
    for only_webhook in ("  on: [needs_attention]\n", ""):  # nothing SLURM can tell, or no email: no mail options
        text = spec.replace("  email: me@example.org\n", "") if not only_webhook else spec.replace("  webhook_env", only_webhook + "  webhook_env")
        assert "mail" not in str(batch_parameters(plan_of(tmp_path, text))["additional_parameters"])


def test_unknown_setup_template_names_the_field_and_line(tmp_path):
    with pytest.raises(SpecError) as err:
        plan_of(tmp_path, "name: x\nsteps: 1\nresources:\n  setup_templates: [nccl, cuda]\n")
    assert "spec.yaml:4: resources.setup_templates" in str(err.value) and "available: nccl, offline" in str(err.value)


def test_refusals_name_the_field_to_change(tmp_path):
    plan = plan_of(tmp_path, GPU_SPEC)
    msg = explain_refusal("sbatch: error: invalid partition specified: gpu\nsbatch: error: Batch job submission failed: Invalid partition name specified", plan)
    assert msg.startswith("SLURM refuses the job array: invalid partition specified: gpu; Batch job submission failed")
    assert "resources.partition: SLURM has no partition 'gpu'" in msg
    msg = explain_refusal("allocation failure: Requested node configuration is not available", plan)
    assert "2 node(s) with 32 CPU(s), 240G memory, 4 GPU(s) per node" in msg and "resources.nodes" in msg
    assert explain_refusal("something new", plan) == "SLURM refuses the job array: something new"


def test_no_controller_is_not_called_a_refusal(tmp_path):
    msg = explain_refusal("sbatch: error: Unable to contact slurm controller (connect failure)", plan_of(tmp_path, GPU_SPEC))
    assert msg.startswith("cannot reach SLURM from here: Unable to contact slurm controller") and "--executor local" in msg


def test_polls_skip_older_jobs_that_reused_an_id():
    import time as _time
    from pathlib import Path as _P

    from orchestrator.scheduler.base import JobRef
    from orchestrator.scheduler.slurm import since_args

    t = _time.mktime((2026, 11, 21, 12, 0, 0, 0, 0, -1))
    refs = [JobRef("7_0", _P("/r"), 0, t + 50), JobRef("7_1", _P("/r"), 1, t)]
    assert since_args(refs) == ["-S", "2026-11-21T11:00:00"]
    assert since_args(refs + [JobRef("8", _P("/r"), 0, None)]) == []  # an attempt without a time: no bound


def srun_line(script: str) -> list[str]:
    import shlex

    [line] = [l for l in script.splitlines() if l.startswith("srun ")]
    return shlex.split(line)


def test_an_apptainer_container_wraps_the_agents_python_and_mounts_what_the_run_needs(tmp_path):
    (tmp_path / "d").mkdir()
    script = write(tmp_path / "d" / "train.py", "print('hi')\n")
    spec = f"""\
name: boxed
steps: 10
model: {{kind: script, script: {script}}}
resources:
  gpus_per_task: 1
  container: {{image: /images/train.sif, mounts: ["/scratch/shared:/shared:ro"]}}
"""
    words = srun_line(render_batch_script(plan_of(tmp_path, spec), python="/usr/bin/python3"))
    i = words.index("apptainer")
    # the run folder and the script's folder at their own paths, then the spec's own mounts; --nv for the GPUs
    assert words[i:i + 7] == ["apptainer", "exec", "--nv", "--bind", f"/scratch/runs/boxed-0123abcd,{tmp_path / 'd'},/scratch/shared:/shared:ro",
                              "/images/train.sif", "python3"], words
    assert words[i + 7:i + 10] == ["-u", "-m", "submitit.core._submit"]
    assert "/usr/bin/python3" not in words  # the login node's interpreter is not the image's


def test_a_pyxis_container_is_srun_options_and_a_hostile_image_name_stays_one_word(tmp_path):
    spec = "name: boxed\nsteps: 10\nresources:\n  container: {runtime: pyxis, image: 'nvcr.io#nvidia/pytorch:24.05-py3 $(touch /tmp/x)', python: /usr/bin/python}\n"
    words = srun_line(render_batch_script(plan_of(tmp_path, spec), python="/usr/bin/python3"))
    assert "--container-image=nvcr.io#nvidia/pytorch:24.05-py3 $(touch /tmp/x)" in words  # one quoted word: never run
    assert "--container-mounts=/scratch/runs/boxed-0123abcd" in words
    assert words[words.index("/usr/bin/python"):][:3] == ["/usr/bin/python", "-u", "-m"]


def test_container_mounts_and_images_are_checked_at_the_spec(tmp_path):
    with pytest.raises(SpecError) as err:
        plan_of(tmp_path, "name: x\nsteps: 1\nresources:\n  container: {image: /i.sif, mounts: ['/a,/b']}\n")
    assert "resources.container.mounts[0]" in str(err.value) and "its own list item" in str(err.value)
    with pytest.raises(SpecError) as err:
        plan_of(tmp_path, "name: x\nsteps: 1\nresources:\n  container: {image: \"/i.sif\\n#SBATCH --uid=0\"}\n")
    assert "resources.container.image" in str(err.value)
    with pytest.raises(SpecError) as err:
        plan_of(tmp_path, "name: x\nsteps: 1\nresources:\n  container: {runtime: docker, image: x}\n")
    assert "resources.container.runtime" in str(err.value)


def test_a_resubmission_reads_the_saved_python_back_as_plain_words():
    from orchestrator.scheduler.slurm_script import python_words

    assert python_words("apptainer exec --bind /r,/d /i.sif python3") == "apptainer exec --bind /r,/d /i.sif python3"
    assert python_words("'/my env/python'") == "'/my env/python'"
    assert python_words("python; rm -rf ~") == "'python;' rm -rf '~'"  # words, never shell syntax
    import sys
    assert python_words("a\nb") == "a b"  # a line break is only a space between words
    for damaged in (None, 42, "", "'unterminated"):
        assert python_words(damaged) == sys.executable


def test_site_limits_are_read_from_slurm_and_a_sweep_over_the_queue_room_waits_for_a_watcher_or_is_refused(tmp_path):
    from test_scheduler import FakeRunner

    from orchestrator.errors import UserError
    from orchestrator.scheduler.site_limits import array_chunks, parse_config_limits, parse_max_submit
    from orchestrator.scheduler.slurm import SlurmScheduler

    assert parse_config_limits("ClusterName = hpc1\nMaxArraySize            = 10\nMaxJobCount             = 10000\nMaxStepCount = 40000\n") == {
        "ClusterName": "hpc1", "MaxArraySize": 10, "MaxJobCount": 10000}
    assert parse_max_submit("\n12\n\n", "normal|\nbig|50\n", "normal") == 12  # the association's
    assert parse_max_submit("", "normal|8\nbig|50\n", "normal") == 8  # the QOS's per user
    assert parse_max_submit("", "", "normal") is None
    assert [list(r) for r in array_chunks(25, 10)] == [list(range(10)), list(range(10, 20)), list(range(20, 25))]
    assert array_chunks(4, None) == [range(0, 4)] and array_chunks(1, 1001) == [range(0, 1)]

    plan = plan_of(tmp_path, (REPO / "configs" / "sweep.yaml").read_text())  # 4 tasks, max_parallel 2
    config = "MaxArraySize = 3\nMaxJobCount = 10000\n"
    parts = SlurmScheduler(FakeRunner({"scontrol show config": config})).split(plan, watched=False)
    assert [len(c) for c in parts.arrays] == [3, 1] and not parts.waiting
    assert "split into 2 arrays" in parts.words and "at most 2 run at once" in parts.words
    # MaxSubmitJobs 3 with one job of the user queued already: two go out now, only when a watcher takes the rest
    limited = {"scontrol show config": config, "sacctmgr -n -P show assoc": "3\n", "squeue -h -r --me": "77_1\n"}
    with pytest.raises(UserError) as err:
        SlurmScheduler(FakeRunner(limited)).split(plan, watched=False)
    assert "the sweep has 4 tasks and SLURM takes 2 more job(s) now (MaxSubmitJobs 3, 1 queued" in str(err.value)
    assert "--watch" in str(err.value) and "orchestrate watch" in str(err.value)
    parts = SlurmScheduler(FakeRunner(limited)).split(plan, watched=True)
    assert parts.arrays == [range(0, 2)] and parts.waiting == range(2, 4) and "the watcher submits the other 2" in parts.words
    # a full queue: nothing goes out now, and `sbatch --test-only` still checks an array SLURM takes
    full = SlurmScheduler(FakeRunner({**limited, "squeue -h -r --me": "77_1\n77_2\n77_3\n"})).split(plan, watched=True)
    assert full.arrays == [] and full.waiting == range(0, 4) and full.first == 3
    # a site that tells nothing: one array, as before, and no squeue to count jobs
    runner = FakeRunner()
    assert SlurmScheduler(runner).split(plan, watched=False).arrays == [range(0, 4)]
    assert not any(c[0] == "squeue" for c in runner.calls)
    # only this cluster's associations are asked (and the spec's QOS only when it names one)
    runner = FakeRunner({"scontrol show config": "ClusterName = hpc1\n"})
    SlurmScheduler(runner).split(plan, watched=False)
    [assoc] = [c for c in runner.calls if c[:5] == ["sacctmgr", "-n", "-P", "show", "assoc"]]
    assert "cluster=hpc1" in assoc and not any(c[4] == "qos" for c in runner.calls if c[0] == "sacctmgr")
    # read once, not once per question: a watcher asks every cycle
    SlurmScheduler(runner).site_limits(None)
    sched = SlurmScheduler(runner)
    before = len(runner.calls)
    sched.site_limits(None), sched.site_limits(None)
    assert len([c for c in runner.calls[before:] if c[0] == "scontrol"]) == 1


def test_the_watcher_submits_waiting_tasks_in_arrays_that_can_hold_a_full_budget():
    from orchestrator.scheduler.site_limits import Room, next_batch, room, SiteLimits

    limits = SiteLimits(max_array_size=10, max_submit=12)
    assert room(limits, 12, None) == Room(0, "MaxSubmitJobs 12, 12 queued", 12, 10)
    assert room(SiteLimits(max_submit=12, max_job_count=100), 3, 95).words == "MaxJobCount 100, 95 queued"
    waiting = list(range(12, 25))
    assert next_batch(waiting, room(limits, 12, None), 3, 12) == []  # no room
    assert next_batch(waiting, room(limits, 10, None), 3, 10) == []  # room for 2: a budget of 3 waits for a third
    assert next_batch(waiting, room(limits, 9, None), 3, 9) == [12, 13, 14]
    assert next_batch(waiting, room(limits, 0, None), 3, 0) == list(range(12, 22))  # never more than MaxArraySize
    assert next_batch(waiting, room(limits, 10, None), None, 10) == [12, 13]  # no budget: whatever fits
    assert next_batch([24], room(limits, 11, None), 3, 11) == [24]  # the last one
    assert next_batch(waiting, room(limits, 10, None), 3, 0) == [12, 13]  # nothing of ours queued: nothing to wait for
    assert next_batch(waiting, room(SiteLimits(max_submit=2), 0, None), 3, 1) == [12, 13]  # a limit below the budget
    assert next_batch(waiting, Room(None), 3, 5) == waiting  # no limit known any more
