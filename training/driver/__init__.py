"""The driver: the process a user starts. It checks the config before anything expensive
(`preflight`), connects to Ray (`cluster`), places one host actor per host (`placement`),
supervises them while they train (`supervisor`, `watchdog`, `failures`, `restarts`), and
writes what the run did (`metrics`, `coverage`, `summary`, `logs`, `tensorboard`, `display`,
and `sweep` for a sweep's trials). Of the host runtime it imports only the actor it places.
"""
