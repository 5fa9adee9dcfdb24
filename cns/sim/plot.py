"""PNG charts of a comparison, one line per strategy (matplotlib, Agg; imported for --plot only)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from cns.sim.recording import RunResult, Series

Values = Callable[[Series], Sequence[float]]
PerSubnet = Callable[[Series], Mapping[str, Sequence[float]]]


def _of_subnet(pick: PerSubnet, name: str) -> Values:
    return lambda series: pick(series)[name]


def _panel(
    axes: Axes, results: Sequence[RunResult], values: Values, label: str, steps: bool
) -> None:
    for result in results:
        minutes = [t / 60 for t in result.series.time]
        axes.plot(
            minutes,
            values(result.series),
            label=result.strategy,
            drawstyle="steps-post" if steps else "default",
            linewidth=1.2,
        )
    axes.set_ylabel(label)
    axes.grid(True, alpha=0.3)


def _chart(
    path: Path,
    title: str,
    results: Sequence[RunResult],
    panels: Sequence[tuple[str, Values]],
    steps: bool = False,
) -> Path:
    figure = Figure(figsize=(10, 2.6 * len(panels) + 0.8), layout="constrained")
    FigureCanvasAgg(figure)
    axes_list = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for axes, (label, values) in zip(axes_list, panels, strict=True):
        _panel(axes, results, values, label, steps)
    axes_list[0].set_title(title)
    axes_list[0].legend(loc="best", fontsize="small")
    axes_list[-1].set_xlabel("simulated time (minutes)")
    figure.savefig(path, dpi=100)
    return path


def write_charts(results: Sequence[RunResult], directory: Path, scenario: str) -> list[Path]:
    """Subnet utilization, batch size, exhausted state (a panel per subnet), pending pods and
    node count over time. Returns the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    subnets = list(results[0].series.utilization)

    def per_subnet(pick: PerSubnet, unit: str) -> list[tuple[str, Values]]:
        return [(f"{unit} ({name})", _of_subnet(pick, name)) for name in subnets]

    # file, title, panels, whether the values are steps
    charts: list[tuple[str, str, list[tuple[str, Values]], bool]] = [
        (
            "utilization",
            "subnet utilization (reserved / capacity)",
            per_subnet(lambda s: {k: [100 * u for u in v] for k, v in s.utilization.items()}, "%"),
            False,
        ),
        ("batch", "batch size the nodes use", per_subnet(lambda s: s.batch, "batch"), True),
        (
            "exhausted",
            "subnet exhausted (controller's hysteresis)",
            per_subnet(lambda s: s.exhausted, "exhausted"),
            True,
        ),
        (
            "pending",
            "pending pods",
            [
                ("unscheduled (no node)", lambda s: s.unscheduled),
                ("waiting for an IP", lambda s: s.waiting_for_ip),
            ],
            False,
        ),
        ("nodes", "nodes", [("nodes", lambda s: s.nodes)], True),
    ]
    return [
        _chart(directory / f"{name}.png", f"{scenario}: {title}", results, panels, steps)
        for name, title, panels, steps in charts
    ]
