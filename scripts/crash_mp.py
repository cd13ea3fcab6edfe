"""The multi-process part of scripts/crash_trials.py (--mp N): 4 separate processes save through
the Python package (torch.distributed, gloo; scripts/crash_mp_worker.py) and one rank or all
ranks get SIGKILL at a random moment of the save.

Cases: {sync, async} x {kill one rank, kill all} x {new directory, overwrite}, trial i runs case
i mod 8. One sibling checkpoint and one previous checkpoint are saved for all cases (each overwrite trial
copies the previous one to its target); each mode's save time is measured once. After the kill the
survivors get --mp-timeout seconds to exit (an error is fine; "timeouts" counts those the runner
had to kill); then the target must load bit-exact as the previous checkpoint or the new seed
(new directory: a clean "no checkpoint" or the new seed), and the sibling bit-exact.
Standard library only.
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "crash_mp_worker.py")
WORLD = 4
SIBLING_SEED, PREVIOUS_SEED = 1, 2


class MpCase:
    def __init__(self, mode, victim, target):
        self.mode, self.victim, self.target = mode, victim, target
        self.name = f"mp4-{mode}-kill{victim}-{target}"
        self.stats = dict(trials=0, committed=0, refused=0, previous=0, timeouts=0, failures=0)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(python, case, path, seed, overwrite):
    port, procs = free_port(), []
    cmd = [python, WORKER, "save", path, "--seed", str(seed)]
    cmd += (["--async"] if case.mode == "async" else []) + (["--overwrite"] if overwrite else [])
    for rank in range(WORLD):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs, " ".join(cmd) + f"   # 4 ranks, MASTER_PORT={port}"


def await_saving(procs):
    """Waits until every rank printed "saving" (or exited); returns the time of the last one."""
    for p in procs:
        while True:
            line = p.stdout.readline()
            if not line or line.strip() == "saving":
                break
    return time.monotonic()


def wait_all(procs, timeout):
    """Waits for every process; kills those still running after `timeout` s. Returns how many."""
    deadline, killed = time.monotonic() + timeout, 0
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
            p.wait()
            killed += 1
        p.stdout.close()
    return killed


def check(trials, items):
    """Checks each (path, expected seeds) in one worker process; returns [(code, message)] and
    the command."""
    cmd = [trials.args.python, WORKER, "check"]
    cmd += [f"{path}={','.join(map(str, expect))}" for path, expect in items]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = [line for line in p.stdout.splitlines() if line[:2] in ("0 ", "3 ", "4 ", "5 ")]
    if p.returncode != 0 or len(lines) != len(items):
        return [(-1, f"the checker failed (exit {p.returncode}): {p.stdout[-2000:]}")] * len(items), cmd
    return [(int(line[0]), line[2:]) for line in lines], cmd


def save_whole(trials, case, path, seed):
    """One uninterrupted 4-process save; returns its time from "saving" to exit."""
    procs, _ = start_ranks(trials.args.python, case, path, seed, False)
    start = await_saving(procs)
    if wait_all(procs, 600) or any(p.returncode for p in procs):
        sys.exit(f"{case.name}: the uninterrupted 4-process save to {path} failed")
    return time.monotonic() - start


def prepare(trials, cases, root):
    """Saves the sibling and the previous checkpoint once for every case (each 4-process save
    costs several seconds of process start-up); a case's duration is its own uninterrupted
    save, measured once."""
    common = os.path.join(root, "mp-common")
    os.makedirs(common, exist_ok=True)
    sibling, previous = os.path.join(common, "sibling"), os.path.join(common, "previous")
    save_whole(trials, cases[0], sibling, SIBLING_SEED)
    save_whole(trials, cases[0], previous, PREVIOUS_SEED)
    for case in cases:
        case.dir = os.path.join(root, case.name)
        os.makedirs(case.dir, exist_ok=True)
        case.sibling, case.previous = sibling, previous
        if case.victim == "one":  # the "all" case of the same mode reuses the time
            case.duration = save_whole(trials, case, os.path.join(case.dir, "measure"), 3)
            shutil.rmtree(os.path.join(case.dir, "measure"))
    for case in cases:
        if case.victim == "all":
            case.duration = next(c.duration for c in cases
                                 if c.victim == "one" and c.mode == case.mode)


def trial(trials, case, index):
    seed = 10 + 3 * index
    tdir = os.path.join(case.dir, f"trial{index:05d}")
    target = os.path.join(tdir, "ckpt")
    overwrite = case.target == "overwrite"
    case.stats["trials"] += 1
    os.makedirs(tdir)
    if overwrite:
        shutil.copytree(case.previous, target)
    procs, command = start_ranks(trials.args.python, case, target, seed, overwrite)
    await_saving(procs)
    delay = trials.kill_delay(case)
    time.sleep(delay)
    victims = procs if case.victim == "all" else [trials.rng.choice(procs)]
    for p in victims:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
    commands = [command + f"   # SIGKILL rank(s) {[procs.index(v) for v in victims]} "
                          f"{delay:.4f} s after 'saving'"]
    case.stats["timeouts"] += wait_all(procs, trials.args.mp_timeout)
    expect = [PREVIOUS_SEED, seed] if overwrite else [seed]
    problems = []
    [(rc, out), (src, sout)], cmd = check(trials, [(target, expect), (case.sibling, [SIBLING_SEED])])
    commands.append(" ".join(cmd))
    if rc == 0:
        committed = out.endswith(f"seed {seed}")
        case.stats["committed"] += committed
        case.stats["previous"] += not committed
    elif rc == 3 and not overwrite:
        case.stats["refused"] += 1
    else:
        problems.append(f"check of the interrupted save (exit {rc}): {out}")
    if src != 0:
        problems.append(f"the sibling checkpoint no longer loads (exit {src}): {sout}")
    trials.finish(case, tdir, problems, commands)


def run_mp(trials, root, count):
    from crash_trials import print_table
    cases = [MpCase(m, v, t) for m in ("sync", "async") for v in ("one", "all")
             for t in ("new", "overwrite")]
    prepare(trials, cases, root)
    print("measured 4-process save times (s): " +
          ", ".join(f"{c.name} {c.duration:.3f}" for c in cases), flush=True)
    started = time.monotonic()
    for i in range(count):
        trial(trials, cases[i % len(cases)], i)
        if (i + 1) % 20 == 0:
            print(f"  {i + 1} multi-process trials, {time.monotonic() - started:.0f} s, "
                  f"{len(trials.failures)} failing", flush=True)
    totals = print_table("multi-process trials (4 processes, gloo, shardpoint.save / async_save)",
                         cases, ["trials", "committed", "refused", "previous", "timeouts", "failures"])
    print("timeouts: survivors of a killed rank still running after --mp-timeout s (killed)")
    return totals
