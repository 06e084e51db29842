"""The trainer: recipe -> data -> ``Trainer.fit()`` (``entry``), checkpoints, optimizer,
pipeline schedule, gradient reduction and monitoring. Imported by module, so importing the
package loads nothing heavy."""
