#include "pci.h"
#include "io.h"

static uint32_t cfg_addr(struct pci_addr a, uint8_t off)
{
    return 0x80000000u | ((uint32_t)a.bus << 16) | ((uint32_t)a.dev << 11) |
           ((uint32_t)a.fn << 8) | (off & 0xfc);
}

uint32_t pci_read32(struct pci_addr a, uint8_t off)
{
    outl(0xcf8, cfg_addr(a, off));
    return inl(0xcfc);
}

static void pci_write16(struct pci_addr a, uint8_t off, uint16_t v)
{
    outl(0xcf8, cfg_addr(a, off));
    outw((uint16_t)(0xcfc + (off & 2)), v);
}

int pci_present(void)
{
    /* Host bridge at 00:00.0 on pc and q35; nothing decodes 0xcf8 on microvm. */
    struct pci_addr a = { 0, 0, 0 };
    uint32_t id = pci_read32(a, 0);
    return id != 0xffffffffu && id != 0;
}

int pci_find(uint16_t vendor, uint16_t device, struct pci_addr *out)
{
    for (uint8_t dev = 0; dev < 32; dev++) {
        for (uint8_t fn = 0; fn < 8; fn++) {
            struct pci_addr a = { 0, dev, fn };
            uint32_t id = pci_read32(a, 0);
            if ((id & 0xffff) == 0xffff) {
                if (fn == 0)
                    break;
                continue;
            }
            if ((id & 0xffff) == vendor && (id >> 16) == device) {
                *out = a;
                return 1;
            }
            if (fn == 0 && !(pci_read32(a, 0x0c) & 0x00800000u))
                break; /* not multi-function */
        }
    }
    return 0;
}

void pci_enable(struct pci_addr a)
{
    uint16_t cmd = (uint16_t)pci_read32(a, 0x04);
    pci_write16(a, 0x04, cmd | 0x7);
}
