/* PCI configuration space via the legacy 0xCF8/0xCFC mechanism (bus 0 scan). */
#ifndef ORISHA_PCI_H
#define ORISHA_PCI_H
#include <stdint.h>

struct pci_addr {
    uint8_t bus, dev, fn;
};

uint32_t pci_read32(struct pci_addr a, uint8_t off);
int pci_present(void);
/* Find the first function with vendor/device on bus 0. Returns 1 if found. */
int pci_find(uint16_t vendor, uint16_t device, struct pci_addr *out);
/* Enable I/O, memory and bus mastering. */
void pci_enable(struct pci_addr a);

#endif
