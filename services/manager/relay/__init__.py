"""A relay shard of the manager: runs the instance streams of the requests the manager hands it and
keeps their tokens, so payloads go from instances to the trainer past the manager (DESIGN.md §11).

- `__main__`: `python -m services.manager.relay --config relay.toml`.
- `config`: the job's `[relay]` settings (report pace) plus the shard's socket, identity and journal.
- `main`: runs a shard until SIGTERM.
- `payload_journal`: the shard's payloads on disk, so a restarted shard holds what it reported.
- `payloads`: every request's tokens from the attempt the manager named last, and their progress.
- `server`: the RelayService servicer: checks each call and has the shard act.
- `shard`: the shard at work: instance streams in, reports out to the manager.
"""
