"""What ``ddpscope dashboard`` tells the page through its environment, declared once:
the command sets them (``cli/dashboard.py``), the page reads them. Importing this module
imports nothing else (the command stays free of Streamlit)."""

#: the folder of runs the page lists and starts runs in (default: ``runs/`` beside app.py)
RUNS_DIR_ENV = "DDPSCOPE_RUNS_DIR"
#: the run the page opens first (``ddpscope dashboard RUN_FOLDER``: its name in RUNS_DIR)
OPEN_RUN_ENV = "DDPSCOPE_OPEN_RUN"
#: "1": start commands from the page even where it listens beyond this machine (``--allow-commands``)
ALLOW_COMMANDS_ENV = "DDPSCOPE_ALLOW_COMMANDS"
#: "0": runs started from the page pay a cold start (no warm launcher kept)
WARM_LAUNCHER_ENV = "DDPSCOPE_WARM_LAUNCHER"
