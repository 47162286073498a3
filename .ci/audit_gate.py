"""Judge a `pip-audit -f json` run for .ci/run (docs/reliability.md, "Dependencies").

    python .ci/audit_gate.py REPORT.json LOG EXIT_STATUS

Fails (exit 1) on any known vulnerability, and on pip-audit failing for a reason other than the
vulnerability service being unreachable. Passes, saying so, when the service cannot be reached (no
network) or answers for none of the dependencies."""

from __future__ import annotations

import json
import os
import re
import sys

UNREACHABLE = re.compile(
    r"ConnectionError|ProxyError|ConnectTimeout|ReadTimeout|NameResolutionError|"
    r"Max retries exceeded|Temporary failure in name resolution|Network is unreachable|"
    r"Connection refused|SSLError|timed out",
    re.I,
)


def judge(report_path: str, log_path: str, status: int) -> tuple[int, str]:
    log = open(log_path, encoding="utf-8", errors="replace").read() if os.path.exists(log_path) else ""
    if not os.path.exists(report_path) or os.path.getsize(report_path) == 0:
        if status != 0 and UNREACHABLE.search(log):
            return 0, "pip-audit: the vulnerability service could not be reached: not failing"
        return 1, f"pip-audit failed (exit {status}) without a report:\n{log[-4000:]}"
    deps = json.load(open(report_path, encoding="utf-8"))["dependencies"]
    found = [(d["name"], d.get("version"), v) for d in deps for v in d.get("vulns", [])]
    if found:
        lines = [
            f"  {n} {ver}: {v['id']} (fixed in: {', '.join(v.get('fix_versions') or []) or 'no fix yet'})"
            for n, ver, v in found
        ]
        return (
            1,
            "pip-audit: known vulnerabilities (upgrade in pyproject.toml, or --ignore-vuln ID with a "
            "reason in .ci/run):\n" + "\n".join(lines),
        )
    skipped = [d for d in deps if d.get("skip_reason")]
    audited = len(deps) - len(skipped)
    if status != 0:
        return 1, f"pip-audit exited {status} with no finding in its report:\n{log[-4000:]}"
    if deps and not audited:
        return 0, (
            f"pip-audit: none of the {len(deps)} dependencies could be audited (the vulnerability "
            f"service is unreachable or has no data for them): not failing"
        )
    return 0, f"pip-audit: no known vulnerabilities in {audited} dependencies ({len(skipped)} skipped)"


if __name__ == "__main__":
    code, message = judge(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    print(message)
    sys.exit(code)
