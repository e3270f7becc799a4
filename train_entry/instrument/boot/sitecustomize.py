"""orchestrate's bootstrap for a rank's program (``model.instrument``; ``train_entry.instrument``).

Python imports ``sitecustomize`` at start-up from its path; the node agent puts this
folder first on the rank's PYTHONPATH. It runs in the program's own interpreter, which may
be another virtual environment's, so it uses the standard library only. It:

1. gives the program back the PYTHONPATH it would have had, and takes this folder off
   ``sys.path`` (children and the program see what they would see without orchestrate);
2. runs the ``sitecustomize`` this one hides, if the environment has one;
3. waits for ``transformers.trainer`` to be imported, and only then loads orchestrate's
   own code, from the files beside this one, to add its callback to every Trainer (and for
   ``transformers.training_args``, to hand the spec's DeepSpeed engine to arguments that
   name none);
4. stays with the rank when the program replaces itself (exec) with another;
5. where the program is a launcher or wraps one (``accelerate launch``, ``torchrun``, and
   the tools that call them: ``trl sft`` in its own process, Axolotl's and LLaMA-Factory's
   CLIs as a child), lets the launcher work out what it would start, then becomes that
   process itself (exec, same pid, this rank's torchrun variables, this bootstrap again):
   the node agent is the launcher, and starts one process per rank.

A program that never imports transformers runs exactly as without it. Nothing here may
stop the program: a failure is a line on stderr, and the program runs uninstrumented.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import re
import subprocess
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))  # holds orchestrator/ and train_entry/
_SAVED = "ORCHESTRATE_INSTRUMENT_PYTHONPATH"  # the program's own PYTHONPATH ("-" where it had none)
# the node agent's variables for this rank: a launcher's own choices never replace them
_RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
_AGENT_ENV = {k: os.environ[k] for k in _RANK_VARS if k in os.environ}


def _restore_path():
    saved = os.environ.pop(_SAVED, None)
    if saved == "-":
        os.environ.pop("PYTHONPATH", None)
    elif saved is not None:
        os.environ["PYTHONPATH"] = saved
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]


def _chain():
    """The environment's own sitecustomize, which this module's name hides."""
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


def _warn(what, exc):
    sys.stderr.write("orchestrate: %s (%s: %s); the program runs on without it\n"
                     % (what, type(exc).__name__, exc))


def _ours(name):
    """orchestrate's package ``name``, from the files beside this bootstrap (never another
    copy the program's environment may hold)."""
    if name in sys.modules:
        return
    init = os.path.join(_ROOT, name, "__init__.py")
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[os.path.dirname(init)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


def _instrument(module, what):
    try:
        _ours("orchestrator")
        _ours("train_entry")
        from train_entry.instrument import hook

        getattr(hook, what)(module)
    except Exception as exc:  # noqa: BLE001 - never the program's failure
        _warn("could not instrument %s" % module.__name__, exc)


def _become(argv, env, said):
    """This process becomes ``argv``, as this rank (``said``: why, for the rank's log)."""
    _leave_process_group()
    env = _booted(env)
    env.update(_AGENT_ENV)
    sys.stderr.write("orchestrate: %s; this rank runs it itself (the node agent is the launcher, one process per rank)\n"
                     % said)
    sys.stdout.flush()
    sys.stderr.flush()
    program = argv[0] if os.sep in argv[0] else _which(argv[0], env)
    _EXECVE(program, argv, env)


def _leave_process_group():
    """A launcher that joined the agent's rendezvous before launching (``trl sft`` builds its
    TrainingArguments first, which set up torch.distributed from this rank's variables) waits
    for every rank's launcher to have joined before it becomes the program: rank 0's exec
    closes the store the group was made through, under a rank still joining it (seen: that
    rank's "Connection reset by peer", and an in-place restart of the whole launch)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return
        dist.barrier()
    except Exception as exc:  # noqa: BLE001 - never stops the program: the agent's restart is what is left
        _warn("waiting for the other ranks' launchers", exc)


def _booted(env):
    """``env`` with this bootstrap first on PYTHONPATH, and the program's own saved."""
    env = dict(env)
    own = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != _HERE)
    env[_SAVED] = own if "PYTHONPATH" in env else "-"  # the next program gets its own back, and is instrumented too
    env["PYTHONPATH"] = _HERE if not own else _HERE + os.pathsep + own
    return env


_EXECVE = os.execve


def _intercept_exec():
    """A program that replaces itself (exec: Axolotl's ``os.execvpe("accelerate", ...)``) is
    still this rank, the same process: the program it becomes is instrumented too. ``os``'s
    other exec functions all end in these two."""
    def execve(path, args, env):
        return _EXECVE(path, args, _booted(env))

    def execv(path, args):
        return _EXECVE(path, args, _booted(os.environ))
    os.execve, os.execv = execve, execv


def _which(name, env):
    for folder in env.get("PATH", os.defpath).split(os.pathsep):
        path = os.path.join(folder, name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError("%s is not on PATH" % name)


def _script_argv(args):
    """torchrun's and accelerate's parsed arguments: the command one rank runs."""
    script = [str(args.training_script)] + [str(a) for a in args.training_script_args]
    if getattr(args, "no_python", False):
        return script
    return [sys.executable] + (["-m"] if getattr(args, "module", False) else []) + script


def _unwrap_torchrun(module):
    """``torch.distributed.run.run(args)``: torchrun's CLI, and accelerate's multi-process launchers."""
    def run(args):
        argv = _script_argv(args)
        _become(argv, os.environ, "torchrun would start " + " ".join(argv))
    run._orchestrate = True
    module.run = run


def _unwrap_accelerate(module):
    """``accelerate launch``'s single-process launcher (``simple_launcher``, in every release
    since 0.2x: it asks ``prepare_simple_launcher_cmd_env`` what to start, then starts it)."""
    if not hasattr(module, "simple_launcher") or not hasattr(module, "prepare_simple_launcher_cmd_env"):
        sys.stderr.write("orchestrate: this accelerate has no simple_launcher: `accelerate launch` runs as it is\n")
        return

    def simple_launcher(args):
        cmd, env = module.prepare_simple_launcher_cmd_env(args)
        argv = [str(c) for c in cmd]
        _become(argv, env, "accelerate launch would start " + " ".join(argv))
    module.simple_launcher = simple_launcher


_LAUNCHER_MODULES = ("torch.distributed.run", "accelerate.commands.launch")


def _launcher_in(argv):
    """The launcher a child's argv starts (``torchrun ...``, ``accelerate launch ...``,
    ``python -m torch.distributed.run ...``), or None."""
    if not isinstance(argv, (list, tuple)) or not argv or not all(isinstance(a, (str, bytes, os.PathLike)) for a in argv):
        return None
    argv = [os.fsdecode(a) for a in argv]
    name = os.path.basename(argv[0])
    if name == "torchrun" or (name == "accelerate" and argv[1:2] == ["launch"]):
        return " ".join(argv[:1 if name == "torchrun" else 2])
    if re.fullmatch(r"python[0-9.]*", name) and argv[1:2] == ["-m"] and argv[2:3] and argv[2] in _LAUNCHER_MODULES:
        return "python -m " + argv[2]
    return None


def _intercept_children():
    """A wrapper that starts a launcher as its child (Axolotl's ``accelerate launch``,
    LLaMA-Factory's ``torchrun``) becomes that launcher instead, which this bootstrap, loaded
    again, then unwraps: the rank stays one process, the one the agent started."""
    original = subprocess.Popen.__init__

    def __init__(self, args, *rest, **kwargs):
        launcher = _launcher_in(args)
        if launcher is not None:
            env = kwargs.get("env")
            if kwargs.get("cwd"):
                os.chdir(kwargs["cwd"])
            argv = [os.fsdecode(a) for a in args]
            _become(argv, os.environ if env is None else env, "the program would start %s as its child" % " ".join(argv))
        original(self, args, *rest, **kwargs)
    subprocess.Popen.__init__ = __init__


def _instrument_trainer(module):
    _instrument(module, "instrument")


def _instrument_args(module):
    _instrument(module, "instrument_args")


_TARGETS = {"transformers.trainer": _instrument_trainer, "transformers.training_args": _instrument_args,
            "torch.distributed.run": _unwrap_torchrun,
            "accelerate.commands.launch": _unwrap_accelerate}
# run as ``python -m``: runpy executes the module's code as __main__, never through
# exec_module; this code imports the module (so its hook runs) and calls its entry point
_AS_MAIN = {"torch.distributed.run": "from torch.distributed.run import main\nmain()\n",
            "accelerate.commands.launch": "from accelerate.commands.launch import main\nmain()\n"}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, finder, fullname):
        self.inner, self.finder, self.fullname = inner, finder, fullname

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.finder.waiting.pop(self.fullname)(module)

    def get_code(self, fullname):  # runpy (``python -m``)
        if fullname in _AS_MAIN:
            return compile(_AS_MAIN[fullname], self.inner.get_filename(fullname), "exec")
        return self.inner.get_code(fullname)

    def __getattr__(self, name):  # get_source, get_filename ...: the real loader's
        return getattr(self.inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of the modules in ``_TARGETS`` so that their
    hook runs once the module has (once each)."""

    def __init__(self):
        self.waiting = dict(_TARGETS)
        self.busy = set()

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.waiting or fullname in self.busy:
            return None
        self.busy.add(fullname)  # the inner search must not find this finder again
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.busy.discard(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, self, fullname)
        return spec


_restore_path()
try:
    _chain()
except Exception as exc:  # noqa: BLE001 - the environment's own hook failing is reported as Python would
    sys.stderr.write("Error in sitecustomize; set PYTHONVERBOSE for traceback:\n%s: %s\n" % (type(exc).__name__, exc))
sys.meta_path.insert(0, _Finder())
_intercept_children()
_intercept_exec()
