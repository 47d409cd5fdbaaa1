"""Model-family adapters, one small module per position scheme; importing a module registers
its adapters with :func:`pckernels.integration.adapters.register_adapter`."""
