#!/usr/bin/python3
"""A plain gRPC client of TensorService in Python (grpcio, no generated code).

Usage: tensor_client.py ADDRESS SIZE[,SIZE...]

For each size it calls Make twice (payload in Tensor.data, then in Tensor.blob)
and checks that the payload arrived inline and byte-exact (the Fill pattern:
byte i is (seed + 7*i) mod 251). Then it sends a tensor whose blob is a payload
to Digest and checks the CRC-32C the server computed. The messages are encoded
and decoded by hand (protobuf wire format), so only grpcio is needed. It prints
one "OK ..." line per check and exits 0, or prints "FAIL ..." and exits 1.
"""

import sys

import grpc

SERVICE = "/gdrpc.examples.tensor.TensorService/"


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def read_varint(buf, i):
    shift = 0
    n = 0
    while True:
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        if not b & 0x80:
            return n, i
        shift += 7


def fields(buf):
    """Yields (field number, wire type, value) of a protobuf message."""
    i = 0
    while i < len(buf):
        key, i = read_varint(buf, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, i = read_varint(buf, i)
        elif wt == 2:
            n, i = read_varint(buf, i)
            v = bytes(buf[i:i + n])
            i += n
        elif wt == 1:
            v = bytes(buf[i:i + 8])
            i += 8
        elif wt == 5:
            v = bytes(buf[i:i + 4])
            i += 4
        else:
            raise ValueError("wire type %d" % wt)
        yield num, wt, v


def length_delimited(num, payload):
    return varint(num << 3 | 2) + varint(len(payload)) + payload


def sized(size, seed, blob):
    """gdrpc.examples.tensor.Sized"""
    out = varint(1 << 3 | 0) + varint(size) + varint(2 << 3 | 0) + varint(seed)
    if blob:
        out += varint(3 << 3 | 0) + varint(1)
    return out


def fill(n, seed):
    period = bytes((seed + 7 * i) % 251 for i in range(251))
    return (period * (n // 251 + 1))[:n]


def crc32c(data):
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    crc = 0xFFFFFFFF
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def device_buffer(buf):
    """Returns (length, inline, owner, token) of a gdr.v1.DeviceBuffer."""
    length, inline, owner, token = 0, b"", b"", b""
    for num, _, v in fields(buf):
        if num == 1:
            length = v
        elif num == 3:
            owner = v
        elif num == 4:
            token = v
        elif num == 8:
            inline = v
    return length, inline, owner, token


def check_make(channel, size, seed, blob):
    make = channel.unary_unary(SERVICE + "Make",
                               request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)
    resp = make(sized(size, seed, blob), timeout=60)
    want = fill(size, seed)
    data, blob_bytes, name = None, b"", b""
    for num, _, v in fields(resp):
        if num == 1:
            name = v
        elif num == 3:
            # A message field that occurs again merges into what came
            # before, as its encodings concatenated would parse.
            data = (data or b"") + v
        elif num == 4:
            blob_bytes = v
    where = "blob" if blob else "data"
    if blob:
        got = blob_bytes
    else:
        if data is None and size > 0:
            return "FAIL size=%d field=data: no data field" % size
        length, got, owner, token = device_buffer(data or b"")
        if owner or token:
            return "FAIL size=%d field=data: an out-of-band descriptor reached a plain client" % size
        if length != size:
            return "FAIL size=%d field=data: length %d" % (size, length)
    if len(got) != size:
        return "FAIL size=%d field=%s: %d bytes arrived" % (size, where, len(got))
    if got != want:
        first = next(i for i in range(size) if got[i] != want[i])
        return "FAIL size=%d field=%s: bytes differ from offset %d" % (size, where, first)
    return "OK make size=%d field=%s name=%s" % (size, where, name.decode())


def check_digest(channel, size, seed):
    digest = channel.unary_unary(SERVICE + "Digest",
                                 request_serializer=lambda b: b,
                                 response_deserializer=lambda b: b)
    payload = fill(size, seed)
    req = length_delimited(1, b"from-python") + length_delimited(4, payload)
    resp = digest(req, timeout=60)
    got_bytes, got_crc = 0, 0
    for num, _, v in fields(resp):
        if num == 2:
            got_bytes = v
        elif num == 3:
            got_crc = v
    want_crc = crc32c(payload)
    if got_bytes != size or got_crc != want_crc:
        return "FAIL digest size=%d: server saw %d bytes crc %08x, want %d crc %08x" % (
            size, got_bytes, got_crc, size, want_crc)
    return "OK digest size=%d crc=%08x" % (size, got_crc)


def main():
    addr, sizes = sys.argv[1], [int(s) for s in sys.argv[2].split(",")]
    options = [
        ("grpc.max_receive_message_length", 256 << 20),
        ("grpc.max_send_message_length", 256 << 20),
        ("grpc.enable_http_proxy", 0),
    ]
    ok = True
    with grpc.insecure_channel(addr, options=options) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        for size in sizes:
            for blob in (False, True):
                line = check_make(channel, size, size % 1000 + 1, blob)
                print(line, flush=True)
                ok = ok and line.startswith("OK")
        line = check_digest(channel, 300 << 10, 11)
        print(line, flush=True)
        ok = ok and line.startswith("OK")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
