"""The command line: a thin typer shell over library functions. No SQL lives here."""
