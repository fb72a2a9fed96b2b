from .cli.main import entry

if __name__ == "__main__":  # (not when a spawned helper process imports this module)
    entry()
