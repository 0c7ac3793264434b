"""`python -m src.config --run_dir [--config_path F --key v ...]` prints the run folder;
`python -m src.config --reference` prints docs/config_reference.md; otherwise the resolved config."""
from src.config.loader import main
from src.errors import run_cli

if __name__ == "__main__":
    run_cli(main)
