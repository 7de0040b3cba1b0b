"""The report's PAC section: numbers from the manifest, a warning only beyond 3 standard errors."""

from __future__ import annotations

import copy

from conftest import as_manifest

from privcode.pac.bounds import mia_success_bound, world_identification_bound
from privcode.pipeline.report_pac import owner_pac_lines, pac_section

B = 2.0**-16
SUMMARY = {
    "m": 8,
    "top_k": 50,
    "worlds": {"lora": {"r": 8}, "steps": 60, "seconds": 51.3},
    "utility": {
        "positions": 256,
        "accuracy": {"public": 0.129, "world": 0.184, "pac": 0.148},
        "gain_retained": 0.356,
        "unanimity_rate": 0.281,
        "mean_active_at_dissent": 2.96,
    },
    "leakage": {
        "sessions": 16,
        "tokens": 48,
        "decoder": "greedy",
        "b": B,
        "mean_private_tokens": 41.75,
        "charged_nats": 41.75 * B,
        "measured_nats": 6.8e-4,
        "measured_nats_se": 8.8e-5,
        "measured_over_charged": 1.07,
        "world_id_success": 0.0625,
        "world_id_success_se": 0.0605,
        "world_id_bound": world_identification_bound(41.75 * B, 8),
        "mia_success": 0.526,
        "mia_success_se": 0.038,
        "mia_bound": mia_success_bound(41.75 * B),
    },
    "canary_emission": {
        "canaries": 15,
        "repetitions": [10, 100],
        "tokens": 24,
        "emitted": {"public": 0, "world": 4, "pac": 3},
        "pac_private_tokens": 9,
    },
    "budget": {
        "b": B,
        "session_budget": 2.0**-10,
        "deployment_budget": 2.0**-4,
        "mia_bound_at_deployment_budget": mia_success_bound(2.0**-4),
        "world_id_bound_at_deployment_budget": world_identification_bound(2.0**-4, 8),
        "private_tokens_per_session": 64,
    },
}


def test_section_shows_the_measurements_and_the_plot(tmp_path):
    lines, plots = pac_section(as_manifest({"summary": SUMMARY}), tmp_path, plots=True)
    text = "\n".join(lines)
    assert "## PAC-private generation (served ensemble)" in text
    assert "| 0.129 | 0.184 | 0.148 | 0.356 | 0.281 | 2.960 |" in text
    assert "0.000637" in text and "0.000680 +- 8.8e-05" not in text  # 3 significant digits
    assert "0.00068 +- 8.8e-05" in text
    assert "64 private tokens" in text and "b = 1.53e-05 nats" in text
    assert "WARNING" not in text  # 1.07 x charged is within 3 se: sampling noise
    assert "public base emitted 0/15, one world 4/15, PAC 3/15" in text
    assert plots == ["pac.png"] and (tmp_path / "pac.png").stat().st_size > 1000
    # The worlds' training seconds (un-noised, non-DP on private halves): owner-only.
    assert "51.3" not in text and " s)" not in text
    assert "51.3 s" in "\n".join(owner_pac_lines(as_manifest({"summary": SUMMARY})))


def test_section_warns_when_a_measurement_beats_its_bound_by_3_se(tmp_path):
    bad = copy.deepcopy(SUMMARY)
    bad["leakage"]["measured_nats"] = 10 * bad["leakage"]["charged_nats"]
    text = "\n".join(pac_section(as_manifest({"summary": bad}), tmp_path, plots=False)[0])
    assert "WARNING: measured information above its bound" in text
    bad = copy.deepcopy(SUMMARY)
    bad["leakage"]["mia_success"] = 0.75
    text = "\n".join(pac_section(as_manifest({"summary": bad}), tmp_path, plots=False)[0])
    assert "WARNING: measured MIA success above its bound" in text


def test_no_pac_stage_no_section(tmp_path):
    assert pac_section(None, tmp_path, plots=True) == ([], [])
