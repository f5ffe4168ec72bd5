#!/usr/bin/env bash
# Installs the real services the integration tests run against: OpenSSH server (tests/test_ssh_provider.py)
# single-node Slurm with munge (tests/test_slurm_provider.py), and headless Chromium with its driver
# (tests/test_dashboard.py).  Idempotent: does nothing when they are
# already installed.  Only installs: the test fixtures start, configure and stop the daemons themselves.
set -euo pipefail
if [ "$(id -u)" -ne 0 ]; then
    echo "setup-services: not root; skipping (the SSH/Slurm tests will be skipped)" >&2
    exit 0
fi
need=()
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
{ [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && command -v sbatch >/dev/null; } || need+=(slurm-wlm)
[ -x /usr/sbin/munged ] || need+=(munge)
command -v chromium >/dev/null || need+=(chromium)          # tests/test_dashboard.py: a real browser
command -v chromedriver >/dev/null || need+=(chromium-driver)
if [ "${#need[@]}" -eq 0 ]; then
    exit 0
fi
echo "setup-services: installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}"; } >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    echo "setup-services: apt-get failed" >&2
    exit 1
fi
rm -f "$log"
