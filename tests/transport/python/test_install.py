"""transport/python installs as a package: pip builds it (setuptools, from pyproject.toml) and
installs it into a fresh directory; the installed copy, not the source tree, then imports, has
the API the README shows, and its `vroll-client` command runs."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import unittest

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "transport", "python")


class InstallTest(unittest.TestCase):
    def test_pip_installs_an_importable_package_and_its_command(self):
        if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode != 0:
            self.fail(f"{sys.executable} has no pip (Debian: python3-pip; scripts/install-deps.sh installs it)")
        with tempfile.TemporaryDirectory() as tmp:
            # A copy: pip builds in the tree it is given, and the source tree stays clean.
            src = os.path.join(tmp, "src")
            shutil.copytree(SOURCE, src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
            target = os.path.join(tmp, "site")
            done = subprocess.run(
                [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                 "--disable-pip-version-check", "--no-warn-script-location", "--target", target, src],
                capture_output=True, text=True)
            self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
            env = dict(os.environ, PYTHONPATH=target)  # the installed copy only
            probe = ("import vroll_client, os; "
                     "from vroll_client import VrollClient, SamplingParams, weights_checksum; "
                     "p = SamplingParams(temperature=0.5, max_tokens=4, n=2); "
                     "print(os.path.realpath(vroll_client.__file__)); print(p.n)")
            run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp)
            self.assertEqual(run.returncode, 0, run.stderr)
            path, n = run.stdout.split()
            self.assertTrue(path.startswith(os.path.realpath(target)), path)
            self.assertEqual(n, "2")
            command = os.path.join(target, "bin", "vroll-client")
            self.assertTrue(os.path.exists(command), os.listdir(target))
            run = subprocess.run([sys.executable, command, "--help"], capture_output=True, text=True, env=env, cwd=tmp)
            self.assertEqual(run.returncode, 0, run.stderr)
            self.assertIn("generate", run.stdout)


if __name__ == "__main__":
    unittest.main()
