// Package wire is the kvix protocol (docs/protocol.md) in pure Go: frames, the rkyv
// 0.8 archives of every message, keyspace seeds and the chain hash. It is byte for
// byte what the Rust crate kvix-wire writes and reads; wire/tests/golden/frames_v5.txt
// holds the vectors both check.
package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// Protocol constants (docs/protocol.md §1).
const (
	ProtocolVersion        = 5 // written by default, the newest read
	OldestVersion          = 4 // the oldest version read
	HeaderLen              = 24
	FrameAlign             = 8
	DefaultMaxFrame uint32 = 4 << 20
	MaxHelloFrame   uint32 = 64 << 10
	FlagNoReply     uint8  = 1
	ByteChunk       uint32 = 256
)

var magic = [4]byte{'K', 'V', 'I', 'X'}

// The frame errors of docs/protocol.md §2, in the order a header is checked. A
// returned error wraps exactly one of them: test it with errors.Is.
var (
	ErrBadMagic           = errors.New("bad magic (not a kvix peer?)")
	ErrUnsupportedVersion = errors.New("unsupported protocol version")
	ErrReserved           = errors.New("reserved header field is not 0")
	ErrUnknownKind        = errors.New("unknown message kind")
	ErrKindTooNew         = errors.New("message kind is newer than the frame's version")
	ErrUnknownFlags       = errors.New("unknown flag bits")
	ErrOversize           = errors.New("frame exceeds the size limit")
	ErrInvalidBody        = errors.New("invalid body")
	// ErrUnexpected: a valid frame of another kind than the one that was due.
	ErrUnexpected = errors.New("unexpected message kind")
)

// Header is a frame's fixed 24-byte header.
type Header struct {
	Version   uint16
	Kind      Kind
	Flags     uint8
	RequestID uint64
	BodyLen   uint32
}

// FrameLen is the bytes the frame occupies: header, body and padding.
func (h Header) FrameLen() int { return HeaderLen + padded(int(h.BodyLen)) }

// WantsReply says whether the sender asked for a reply.
func (h Header) WantsReply() bool { return h.Flags&FlagNoReply == 0 }

func padded(n int) int { return (n + FrameAlign - 1) &^ (FrameAlign - 1) }

func (h Header) put(out []byte) {
	copy(out[0:4], magic[:])
	binary.LittleEndian.PutUint16(out[4:6], h.Version)
	out[6] = byte(h.Kind)
	out[7] = h.Flags
	binary.LittleEndian.PutUint64(out[8:16], h.RequestID)
	binary.LittleEndian.PutUint32(out[16:20], h.BodyLen)
	binary.LittleEndian.PutUint32(out[20:24], 0)
}

// ReadHeader checks a frame header as the Rust reader does (same checks, same order).
func ReadHeader(b []byte, maxFrame uint32) (Header, error) {
	if len(b) < HeaderLen {
		return Header{}, fmt.Errorf("%w: %d header bytes", ErrInvalidBody, len(b))
	}
	if [4]byte(b[0:4]) != magic {
		return Header{}, fmt.Errorf("%w: % x", ErrBadMagic, b[0:4])
	}
	h := Header{
		Version:   binary.LittleEndian.Uint16(b[4:6]),
		Kind:      Kind(b[6]),
		Flags:     b[7],
		RequestID: binary.LittleEndian.Uint64(b[8:16]),
		BodyLen:   binary.LittleEndian.Uint32(b[16:20]),
	}
	if h.Version < OldestVersion || h.Version > ProtocolVersion {
		return h, fmt.Errorf("%w: %d (this side speaks %d to %d)", ErrUnsupportedVersion, h.Version, OldestVersion, ProtocolVersion)
	}
	if r := binary.LittleEndian.Uint32(b[20:24]); r != 0 {
		return h, fmt.Errorf("%w: %#x", ErrReserved, r)
	}
	since, ok := h.Kind.Since()
	if !ok {
		return h, fmt.Errorf("%w: %d", ErrUnknownKind, b[6])
	}
	if since > h.Version {
		return h, fmt.Errorf("%w: kind %d is new in version %d; the frame says version %d", ErrKindTooNew, b[6], since, h.Version)
	}
	if unknown := h.Flags &^ FlagNoReply; unknown != 0 {
		return h, fmt.Errorf("%w: %#02x", ErrUnknownFlags, unknown)
	}
	if n := uint64(HeaderLen) + uint64(padded(int(h.BodyLen))); n > uint64(maxFrame) {
		return h, fmt.Errorf("%w: %d bytes, the limit is %d", ErrOversize, n, maxFrame)
	}
	return h, nil
}

// Frame is a whole frame cut from the front of a read buffer.
type Frame struct {
	Header Header
	Body   []byte // without padding, aliasing the buffer
	Len    int    // bytes to consume: header and padded body
}

// SplitFrame finds the frame at the front of buf: ok is false while more bytes are
// needed. The header is checked as soon as its 24 bytes are in.
func SplitFrame(buf []byte, maxFrame uint32) (f Frame, ok bool, err error) {
	if len(buf) < HeaderLen {
		return Frame{}, false, nil
	}
	h, err := ReadHeader(buf[:HeaderLen], maxFrame)
	if err != nil {
		return Frame{}, false, err
	}
	n := h.FrameLen()
	if len(buf) < n {
		return Frame{}, false, nil
	}
	return Frame{Header: h, Body: buf[HeaderLen : HeaderLen+int(h.BodyLen)], Len: n}, true, nil
}

// Message decodes and validates the frame's body as its kind.
func (f Frame) Message() (Message, error) { return Decode(f.Header.Kind, f.Body) }

// Append appends one frame carrying m in the current version to out, which holds
// whole frames only (so its length is a multiple of 8).
func Append(out []byte, m Message, requestID uint64, flags uint8) ([]byte, error) {
	return AppendVersion(out, m, ProtocolVersion, requestID, flags)
}

// ErrEncode is wrapped by every error Append returns.
var ErrEncode = errors.New("cannot encode")

// AppendVersion is Append with the header saying version.
func AppendVersion(out []byte, m Message, version uint16, requestID uint64, flags uint8) ([]byte, error) {
	kind := m.Kind()
	if version < OldestVersion || version > ProtocolVersion {
		return out, fmt.Errorf("%w: protocol version %d", ErrEncode, version)
	}
	if since, _ := kind.Since(); since > version {
		return out, fmt.Errorf("%w: %v is new in version %d, not in version %d", ErrEncode, kind, since, version)
	}
	if len(out)%FrameAlign != 0 {
		return out, fmt.Errorf("%w: frames are appended on 8-byte boundaries", ErrEncode)
	}
	start := len(out)
	out = append(out, make([]byte, HeaderLen)...)
	e := encoder{b: out}
	m.encode(&e)
	out = e.b
	bodyLen := len(out) - start - HeaderLen
	if uint64(bodyLen) > 0xFFFF_FFFF {
		return out[:start], fmt.Errorf("%w: %v body of %d bytes", ErrEncode, kind, bodyLen)
	}
	out = append(out, make([]byte, padded(bodyLen)-bodyLen)...)
	Header{Version: version, Kind: kind, Flags: flags, RequestID: requestID, BodyLen: uint32(bodyLen)}.put(out[start:])
	return out, nil
}

// ValidateStream reads bytes as a stream of frames, decoding every body: the number of
// whole valid frames, or the first error. What the fuzz target drives.
func ValidateStream(b []byte, maxFrame uint32) (int, error) {
	frames := 0
	for {
		f, ok, err := SplitFrame(b, maxFrame)
		if err != nil {
			return frames, err
		}
		if !ok {
			return frames, nil
		}
		if _, err := f.Message(); err != nil {
			return frames, err
		}
		b = b[f.Len:]
		frames++
	}
}
