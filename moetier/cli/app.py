"""The `moetier` command line: one typer app, its commands gathered from one module per command group.

Thin by design: every command is a few lines over the library (parse, call,
print a rich table or --json). Command modules import the library inside the
commands, so `moetier simulate` never imports torch and `moetier --help`
starts at once. Bad input — a missing folder, an unsupported architecture, a
malformed ids file — prints one line `moetier: error: ...` and exits 2.
"""

from __future__ import annotations

import typer

from moetier.cli import layout, model, profile, serve, sim, worker

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
                  help="Run Mixture-of-Experts models whose experts do not fit in GPU memory.")

for command in (model.run, model.score, model.info, model.synth):
    app.command()(command)
app.add_typer(layout.layout_app, name="layout")
app.command()(layout.calibrate)
app.command("example-sessions")(profile.example_sessions)
app.command("profile")(profile.profile)
app.add_typer(profile.bias_app, name="bias")
app.command("kl")(profile.kl)
app.command("sweep")(profile.sweep)
app.command()(worker.worker)
app.add_typer(worker.keys_app, name="keys")
app.command()(worker.ping)
app.command()(worker.launch)
app.command()(sim.simulate)
app.command()(serve.serve)
app.command()(serve.chat)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
