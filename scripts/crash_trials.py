#!/usr/bin/env python3
"""Crash-consistency campaign: saves killed with SIGKILL at random moments, then checked.

Each in-process trial (tools/crash_driver.cc) takes one case of
{1, 4 ranks} x {native, torch-dcp} x {new directory, overwrite} x {sync, async} (trial i runs
case i mod 16, so the cases are covered evenly; every other round of the 16 saves with direct
writes, SaveOptions::direct_io) and:
  1. overwrite: saves the previous checkpoint (seed S-1) at the target first;
  2. starts the save of seed S and sends SIGKILL after a delay drawn uniformly over the case's
     measured save time (a quarter of the trials draw from the last 15% and just past the end,
     around the commit);
  3. checks the target with a random number of load ranks (1-4, resharding): overwrite: it must
     load bit-exact as S-1, or as S when the save committed; new directory: a clean "no
     checkpoint" refusal or bit-exact S. The case's sibling checkpoint (saved once, never written
     again) must load bit-exact too;
  4. saves S again into the same directory (over the leftovers) and checks it loads bit-exact.
With --mp N it also runs N trials where 4 separate processes save through the Python package
(torch.distributed gloo; scripts/crash_mp_worker.py, run by --python) and one rank or all ranks
are killed: the survivors must exit (an error is fine) within --mp-timeout seconds or they are
killed and counted; the previous checkpoint must load bit-exact.

Prints a table per case and exits 1 on any failure, keeping the failing trial's directory and
printing the commands that reproduce it. Python 3 standard library only (the --mp workers need
torch and shardpoint). See docs/TESTING.md, "Crash consistency".
"""
import argparse
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SIBLING_SEED = 1
EXIT_LOADED, EXIT_NO_CHECKPOINT = 0, 3


class Case:
    def __init__(self, ranks, fmt, target, mode):
        self.ranks, self.fmt, self.target, self.mode = ranks, fmt, target, mode
        self.name = f"r{ranks}-{fmt}-{target}-{mode}"
        self.duration = 0.0
        self.times = []  # uninterrupted save times seen so far (s, from "saving" to exit)
        self.stats = dict(trials=0, finished=0, committed=0, refused=0, previous=0, failures=0)


def cpp_cases():
    return [Case(r, f, t, m) for r in (1, 4) for f in ("native", "torch-dcp")
            for t in ("new", "overwrite") for m in ("sync", "async")]


class Trials:
    """Runs the trials; `failures` collects (trial directory, message, commands)."""

    def __init__(self, args):
        self.args, self.rng = args, random.Random(args.seed)
        self.failures = []

    # --- the driver ---------------------------------------------------------------------------

    def save_cmd(self, case, path, seed, overwrite, direct=False):
        cmd = [self.args.driver, "save", path, "--seed", str(seed), "--ranks", str(case.ranks),
               "--format", case.fmt, "--mb", str(self.args.mb)]
        return (cmd + (["--overwrite"] if overwrite else []) + (["--async"] if case.mode == "async" else [])
                + (["--direct-io"] if direct else []))

    def check_cmd(self, path, expect, ranks):
        return [self.args.driver, "check", path, "--expect", ",".join(map(str, expect)),
                "--ranks", str(ranks), "--mb", str(self.args.mb)]

    @staticmethod
    def run(cmd):
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return p.returncode, p.stdout.strip()

    def start_and_kill(self, cmd, delay):
        """Starts cmd, waits for its "saving" line, sleeps `delay` (None: no kill) and sends
        SIGKILL. Returns (exit code, seconds from "saving" to exit or kill, output)."""
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = p.stdout.readline()
        start = time.monotonic()
        if line.strip() != "saving":
            rest = p.stdout.read()
            p.wait()
            return p.returncode, 0.0, (line + rest).strip()
        if delay is not None:
            try:
                p.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)
        rest = p.stdout.read()
        p.wait()
        elapsed = time.monotonic() - start
        p.stdout.close()
        return p.returncode, elapsed, rest.strip()

    # --- per case -------------------------------------------------------------------------------

    def prepare(self, case, root):
        """Makes the case's directory and sibling checkpoint; measures the save time."""
        case.dir = os.path.join(root, case.name)
        os.makedirs(case.dir, exist_ok=True)
        case.sibling = os.path.join(case.dir, "sibling")
        rc, out = self.run(self.save_cmd(case, case.sibling, SIBLING_SEED, False))
        if rc != 0:
            sys.exit(f"{case.name}: cannot save the sibling checkpoint: {out}")
        times = []
        for i in range(3):
            path = os.path.join(case.dir, f"measure{i}")
            if case.target == "overwrite":
                self.run(self.save_cmd(case, path, 2, False))
            rc, elapsed, _ = self.start_and_kill(self.save_cmd(case, path, 3, case.target == "overwrite"), None)
            if rc != 0:
                sys.exit(f"{case.name}: the uninterrupted save failed (exit {rc})")
            self.observe(case, elapsed)
            shutil.rmtree(path)

    @staticmethod
    def observe(case, elapsed):
        """Records an uninterrupted save's time: the kill window follows the machine's load (the
        median of the last 7 saves of the case), so kills keep landing inside the save."""
        case.times = (case.times + [elapsed])[-7:]
        case.duration = statistics.median(case.times)

    def kill_delay(self, case):
        if self.rng.random() < 0.25:
            return self.rng.uniform(0.85, 1.1) * case.duration
        return self.rng.uniform(0.0, 1.0) * case.duration

    def trial(self, case, index, direct=False):
        seed = 10 + 3 * index
        tdir = os.path.join(case.dir, f"trial{index:05d}")
        target = os.path.join(tdir, "ckpt")
        overwrite = case.target == "overwrite"
        commands, problems = [], []
        case.stats["trials"] += 1

        def do(cmd):
            commands.append(" ".join(cmd))
            return self.run(cmd)

        if overwrite:
            rc, out = do(self.save_cmd(case, target, seed - 1, False))
            if rc != 0:
                problems.append(f"saving the previous checkpoint failed: {out}")
        delay = self.kill_delay(case)
        save = self.save_cmd(case, target, seed, overwrite, direct)
        commands.append(" ".join(save) + f"   # SIGKILL {delay:.4f} s after 'saving'")
        save_rc, elapsed, _ = self.start_and_kill(save, delay)
        case.stats["finished"] += save_rc == 0
        if save_rc == 0 and elapsed < delay:
            self.observe(case, elapsed)
        expect = [seed - 1, seed] if overwrite else [seed]
        rc, out = do(self.check_cmd(target, expect, self.rng.randint(1, 4)))
        committed = rc == EXIT_LOADED and out.endswith(f"seed {seed}")
        if rc == EXIT_LOADED:
            case.stats["committed"] += committed
            case.stats["previous"] += not committed
        elif rc == EXIT_NO_CHECKPOINT and not overwrite:
            case.stats["refused"] += 1
        else:
            problems.append(f"check of the interrupted save (exit {rc}): {out}")
        if save_rc == 0 and not committed:
            problems.append("the save exited 0 but its checkpoint is not the one loaded")
        rc, out = do(self.check_cmd(case.sibling, [SIBLING_SEED], self.rng.randint(1, 4)))
        if rc != EXIT_LOADED:
            problems.append(f"the sibling checkpoint no longer loads (exit {rc}): {out}")
        retry = self.save_cmd(case, target, seed, overwrite or committed, direct)
        commands.append(" ".join(retry))
        rc, elapsed, out = self.start_and_kill(retry, None)
        if rc == 0:
            self.observe(case, elapsed)
        if rc != 0:
            problems.append(f"the retry save over the leftovers failed (exit {rc}): {out}")
        else:
            rc, out = do(self.check_cmd(target, [seed], self.rng.randint(1, 4)))
            if rc != EXIT_LOADED:
                problems.append(f"the retry save does not load (exit {rc}): {out}")
        self.finish(case, tdir, problems, commands)

    def finish(self, case, tdir, problems, commands):
        if problems:
            case.stats["failures"] += 1
            self.failures.append((tdir, problems, commands))
        elif not self.args.keep:
            shutil.rmtree(tdir, ignore_errors=True)


def print_table(title, cases, columns):
    print(f"\n{title}")
    header = f"{'case':34}" + "".join(f"{c:>11}" for c in columns)
    print(header)
    print("-" * len(header))
    totals = dict.fromkeys(columns, 0)
    for case in cases:
        print(f"{case.name:34}" + "".join(f"{case.stats[c]:>11}" for c in columns))
        for c in columns:
            totals[c] += case.stats[c]
    print("-" * len(header))
    print(f"{'total':34}" + "".join(f"{totals[c]:>11}" for c in columns))
    return totals


def run_cpp(trials, root, count):
    cases = cpp_cases()
    for case in cases:
        trials.prepare(case, root)
    print("measured save times (s): " + ", ".join(f"{c.name} {c.duration:.3f}" for c in cases))
    started = time.monotonic()
    for i in range(count):
        trials.trial(cases[i % len(cases)], i, direct=(i // len(cases)) % 2 == 1)
        if (i + 1) % 100 == 0:
            print(f"  {i + 1} trials, {time.monotonic() - started:.0f} s, "
                  f"{len(trials.failures)} failing", flush=True)
    totals = print_table("in-process trials (tools/crash_driver)", cases,
                         ["trials", "finished", "committed", "refused", "previous", "failures"])
    print("every other round of the cases saved with direct writes (--direct-io); "
          "finished: the save exited before the kill; committed: the check loaded the new seed; "
          "refused: no committed checkpoint (new directory); previous: the previous checkpoint "
          "loaded intact (overwrite)")
    return totals


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--driver", required=True, help="the crash_driver executable (build/tools/crash_driver)")
    p.add_argument("--trials", type=int, default=1000, help="in-process trials (0: none)")
    p.add_argument("--seed", type=int, default=0, help="seeds the kill times and load rank counts")
    p.add_argument("--dir", help="scratch directory (default: a new one under /tmp)")
    p.add_argument("--mb", type=int, default=16, help="size of the saved state in MiB")
    p.add_argument("--keep", action="store_true", help="keep passing trials' directories")
    p.add_argument("--mp", type=int, default=0, help="multi-process trials through the Python package")
    p.add_argument("--python", default=sys.executable, help="Python with torch and shardpoint (--mp)")
    p.add_argument("--mp-timeout", type=float, default=60.0,
                   help="seconds the survivors of a killed rank get to exit before they are killed")
    return p.parse_args()


def main():
    args = parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="sp-crash-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.makedirs(root, exist_ok=True)
    print(f"crash trials in {root} (--seed {args.seed}, --mb {args.mb})", flush=True)
    trials = Trials(args)
    failed = 0
    if args.trials:
        failed += run_cpp(trials, root, args.trials)["failures"]
    if args.mp:
        from crash_mp import run_mp  # noqa: E402 (beside this script)
        failed += run_mp(trials, root, args.mp)["failures"]
    for tdir, problems, commands in trials.failures:
        print(f"\nFAILED trial, kept in {tdir}:")
        for p in problems:
            print(f"  {p}")
        print("  to reproduce (in order):")
        for c in commands:
            print(f"    {c}")
    summary = f"crash trials: {failed} failing"
    print("\n" + summary)
    if not failed and not args.keep and not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    sys.exit(main())
