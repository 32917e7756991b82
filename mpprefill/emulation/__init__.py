"""The emulated accelerator: a device clock charging each forward a roofline's time."""
