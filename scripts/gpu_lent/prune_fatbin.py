"""List, or prune to one SM architecture, the CUDA fat binaries inside an ELF shared library.

    python prune_fatbin.py LIB.so                 # bytes of cubin/PTX per (kind, arch)
    python prune_fatbin.py LIB.so OUT.so 90       # zero every payload but sm_90 cubins

Zeroed payloads keep their sizes (the ELF is unchanged in layout) and compress to almost nothing,
which is how onnxruntime-gpu's 284 MB CUDA provider fits a 64 MiB transfer (docs/gpu.md). A device
only loads cubins of its own major architecture, so the zeroed ones are never read on that device.
Fat binary layout: a 16-byte header (magic 0xBA55ED50, version 1, header size 16, payload size),
then entries of a header (kind 1 PTX / 2 ELF, header size, payload size, arch at byte 28) and
their payload.
"""

import collections
import struct
import sys
from pathlib import Path

MAGIC = 0xBA55ED50


def entries(buf):
    pos = 0
    while (i := buf.find(struct.pack("<I", MAGIC), pos)) >= 0:
        _, version, header, size = struct.unpack_from("<IHHQ", buf, i)
        if version != 1 or header != 16:
            pos = i + 4
            continue
        p, end = i + header, i + header + size
        while p < end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", buf, p)
            if kind not in (1, 2, 4) or entry_header < 64 or p + entry_header + payload > end:
                break
            yield p + entry_header, payload, kind, struct.unpack_from("<I", buf, p + 28)[0]
            p += entry_header + payload
        pos = end


def main(argv):
    buf = bytearray(Path(argv[0]).read_bytes())
    keep = int(argv[2]) if len(argv) > 2 else None
    sizes = collections.Counter()
    for start, payload, kind, arch in entries(buf):
        sizes["ptx" if kind == 1 else "cubin", arch] += payload
        if keep is not None and not (kind == 2 and arch == keep):
            buf[start : start + payload] = bytes(payload)
    for (kind, arch), n in sorted(sizes.items()):
        print(f"{kind} sm_{arch}: {n / 2**20:.1f} MiB")
    if keep is not None:
        Path(argv[1]).write_bytes(buf)


if __name__ == "__main__":
    main(sys.argv[1:])
