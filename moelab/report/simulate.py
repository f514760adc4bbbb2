"""Report section: a simulated what-if on a real model shape (``moelab.simulate``).

The simulator is a separate capability. When ``moelab.simulate`` is importable and provides
``report_section(ctx) -> moelab.report.Section`` (a what-if grid on a public model shape such
as DeepSeek-V3 on a hardware preset, with its figures), this section shows it; otherwise it
is drawn as "not available in this build". No numbers are made up here.
"""

from __future__ import annotations

import importlib

from moelab.report import ReportContext, Section, SectionUnavailable, register_section


def simulate_section(ctx: ReportContext) -> Section:
    try:
        sim = importlib.import_module("moelab.simulate")
    except ImportError as exc:
        raise SectionUnavailable(
            f"the simulator (moelab.simulate) is not part of this build ({exc}); this section shows its "
            "what-if grid on a real model shape once it is."
        ) from exc
    hook = getattr(sim, "report_section", None)
    if not callable(hook):
        raise SectionUnavailable(
            "moelab.simulate is present but provides no report_section(ctx) for the demo report yet."
        )
    return hook(ctx)


register_section(
    "simulate", simulate_section, order=130, title="Simulated what-if on a real model shape",
    read="Predicted tokens/s and stalls of a large model shape (DeepSeek-V3) on a hardware preset for each "
         "cache capacity and deferral setting, beside the oracle bound: what the policies would buy on a "
         "machine this one cannot stand in for.",
)
