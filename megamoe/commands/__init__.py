"""The command-line programs, one module per console entry point (setup.py ``console_scripts``):
each has ``main(argv)`` (raises on bad input; tests call it in process) and ``cli()`` (one-line
errors, see ``megamoe.commands.cli.run_main``). ``tools/*.py`` are thin wrappers over the same functions,
for a checkout that is not installed."""
