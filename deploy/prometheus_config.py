"""A Prometheus configuration for a cluster whose metrics ports are known only once it runs
(`pagekv up` picks free ones each run).

It is deploy/prometheus.yml, docker compose's configuration, with the live targets in place of
the compose service names: the same scrape interval, the same job names (which the rules and
the Grafana dashboards select on) and the same rules (deploy/prometheus/*.rules.yml, named by
their path here rather than the compose container's). One file to change either.
"""

from __future__ import annotations

from pathlib import Path

import yaml

DEPLOY_DIR = Path(__file__).resolve().parent
COMPOSE_CONFIG = DEPLOY_DIR / "prometheus.yml"
RULES = DEPLOY_DIR / "prometheus" / "*.rules.yml"
POD_JOB = "pagekv-pods"
ROUTER_JOB = "pagekv-router"


def scrape_config(pod_targets: list[str], router_targets: list[str],
                  credentials_file: Path | None = None) -> dict:
    """The compose configuration with these `host:port` targets (the metrics ports, serving
    /metrics) for its pod and router jobs; `credentials_file`: the file holding the metrics
    ports' bearer token (--metrics-token), which those jobs then send."""
    config = yaml.safe_load(COMPOSE_CONFIG.read_text())
    config["rule_files"] = [str(RULES)]
    targets = {POD_JOB: pod_targets, ROUTER_JOB: router_targets}
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    missing = set(targets) - set(jobs)
    if missing:  # the two files are kept together: a renamed job must be renamed here too
        raise ValueError(f"{COMPOSE_CONFIG} has no job {', '.join(sorted(missing))}")
    for name, hosts in targets.items():
        jobs[name]["static_configs"] = [{"targets": hosts}]
        if credentials_file is not None:
            jobs[name]["authorization"] = {"type": "Bearer",
                                           "credentials_file": str(credentials_file)}
    config["scrape_configs"] = [job for job in jobs.values()
                                if job["job_name"] not in targets or targets[job["job_name"]]]
    return config


def write_scrape_config(path: Path, pod_targets: list[str], router_targets: list[str],
                        about: str, credentials_file: Path | None = None) -> Path:
    """Write the configuration to `path` (atomically: a Prometheus reloading it never reads
    half a file), headed by a comment saying what it is `about`."""
    header = (f"# Prometheus for {about}, written by `pagekv up`: its metrics ports change\n"
              f"# with every run. Settings and jobs: {COMPOSE_CONFIG}.\n"
              f"# Run: prometheus --config.file={path}\n")
    body = yaml.safe_dump(scrape_config(pod_targets, router_targets, credentials_file),
                          sort_keys=False)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(header + body)
    tmp.replace(path)
    return path
