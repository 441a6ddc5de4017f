package wire

import (
	"encoding/binary"
	"fmt"
	"math"
	"unicode/utf8"
)

// The rkyv 0.8 archive format (docs/protocol.md §3): little-endian scalars, repr(C)
// structs, one-byte enum tags, 8-byte strings (inline up to 8 bytes) and vectors
// reached by i32 offsets. The encoder writes as rkyv does, in one post-order pass:
// a value's out-of-line data first (field by field), then the value itself, the root
// last. Positions are offsets into the frame buffer, whose bodies start 8-aligned.

const inlineCap = 8

type encoder struct{ b []byte }

// align pads with zeros to a multiple of n.
func (e *encoder) align(n int) {
	for len(e.b)%n != 0 {
		e.b = append(e.b, 0)
	}
}

// reserve aligns to align, appends size zero bytes and returns where they start.
func (e *encoder) reserve(size, align int) int {
	e.align(align)
	at := len(e.b)
	e.b = append(e.b, make([]byte, size)...)
	return at
}

func (e *encoder) u8(at int, v uint8)   { e.b[at] = v }
func (e *encoder) u32(at int, v uint32) { binary.LittleEndian.PutUint32(e.b[at:], v) }
func (e *encoder) u64(at int, v uint64) { binary.LittleEndian.PutUint64(e.b[at:], v) }
func (e *encoder) f32(at int, v float32) {
	binary.LittleEndian.PutUint32(e.b[at:], math.Float32bits(v))
}
func (e *encoder) boolean(at int, v bool) {
	if v {
		e.b[at] = 1
	}
}

// strData writes a string's bytes out of line when it is too long to inline: where
// they start, or -1.
func (e *encoder) strData(s string) int {
	if len(s) <= inlineCap {
		return -1
	}
	at := len(e.b)
	e.b = append(e.b, s...)
	return at
}

// str writes the 8-byte string at at, its bytes at data (from strData).
func (e *encoder) str(at int, s string, data int) {
	if data < 0 {
		n := copy(e.b[at:at+inlineCap], s)
		for i := n; i < inlineCap; i++ {
			e.b[at+i] = 0xFF
		}
		return
	}
	n := uint32(len(s))
	e.u32(at, (n&0x3F)|0x80|((n&^0x3F)<<2))
	e.u32(at+4, uint32(int32(data-at)))
}

// vec writes the 8-byte vector header at at for n elements starting at data.
func (e *encoder) vec(at, data, n int) {
	e.u32(at, uint32(int32(data-at)))
	e.u32(at+4, uint32(n))
}

func (e *encoder) u64sData(v []uint64) int {
	e.align(8)
	at := len(e.b)
	for _, x := range v {
		e.b = binary.LittleEndian.AppendUint64(e.b, x)
	}
	return at
}

func (e *encoder) u32sData(v []uint32) int {
	e.align(4)
	at := len(e.b)
	for _, x := range v {
		e.b = binary.LittleEndian.AppendUint32(e.b, x)
	}
	return at
}

func (e *encoder) bytesData(v []byte) int {
	at := len(e.b)
	e.b = append(e.b, v...)
	return at
}

// decoder reads an archived body. Every read is bounds-checked; a failure is
// ErrInvalidBody naming what was wrong. Unlike rkyv's validator it does not insist
// on the encoder's object order: Go copies what it reads, so overlapping objects
// cannot alias anything.
type decoder struct {
	b   []byte
	err error
}

func (d *decoder) fail(format string, args ...any) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: "+format, append([]any{ErrInvalidBody}, args...)...)
	}
}

// root is where a root object of size bytes starts: the body's last bytes.
func (d *decoder) root(size int) int {
	if len(d.b) < size {
		d.fail("%d bytes, the root takes %d", len(d.b), size)
		return -1
	}
	return len(d.b) - size
}

func (d *decoder) u8(at int) uint8   { return d.b[at] }
func (d *decoder) u32(at int) uint32 { return binary.LittleEndian.Uint32(d.b[at:]) }
func (d *decoder) u64(at int) uint64 { return binary.LittleEndian.Uint64(d.b[at:]) }
func (d *decoder) f32(at int) float32 {
	return math.Float32frombits(binary.LittleEndian.Uint32(d.b[at:]))
}

func (d *decoder) boolean(at int) bool {
	switch d.b[at] {
	case 0:
		return false
	case 1:
		return true
	}
	d.fail("bool byte %d at %d", d.b[at], at)
	return false
}

// tag reads an enum tag below n.
func (d *decoder) tag(at int, n uint8, what string) uint8 {
	t := d.b[at]
	if t >= n {
		d.fail("%s tag %d at %d (%d variants)", what, t, at, n)
		return 0
	}
	return t
}

// target resolves the relative pointer stored at ptr, counted from base, to n
// objects of size and align bytes.
func (d *decoder) target(base, ptr, n, size, align int) (int, bool) {
	off := int64(int32(d.u32(ptr)))
	start := int64(base) + off
	end := start + int64(n)*int64(size)
	if start < 0 || end > int64(len(d.b)) {
		d.fail("pointer at %d to [%d, %d) is outside the %d-byte body", ptr, start, end, len(d.b))
		return 0, false
	}
	if start%int64(align) != 0 {
		d.fail("pointer at %d to %d is not %d-aligned", ptr, start, align)
		return 0, false
	}
	return int(start), true
}

func (d *decoder) str(at int) string {
	w := d.u32(at)
	if d.b[at]&0xC0 != 0x80 {
		n := inlineCap
		for i := 0; i < inlineCap; i++ {
			if d.b[at+i] == 0xFF {
				n = i
				break
			}
		}
		s := d.b[at : at+n]
		if !utf8.Valid(s) {
			d.fail("string at %d is not UTF-8", at)
			return ""
		}
		return string(s)
	}
	n := int((w & 0x3F) | ((w &^ 0xFF) >> 2))
	if n <= inlineCap {
		d.fail("out-of-line string at %d of %d bytes", at, n)
		return ""
	}
	// The offset counts from the string, not from its pointer field.
	start, ok := d.target(at, at+4, n, 1, 1)
	if !ok {
		return ""
	}
	s := d.b[start : start+n]
	if !utf8.Valid(s) {
		d.fail("string at %d is not UTF-8", at)
		return ""
	}
	return string(s)
}

// vec reads the vector header at at: where its n elements start.
func (d *decoder) vec(at, size, align int) (start, n int) {
	n = int(d.u32(at + 4))
	start, ok := d.target(at, at, n, size, align)
	if !ok {
		return 0, 0
	}
	return start, n
}

func (d *decoder) u64s(at int) []uint64 {
	start, n := d.vec(at, 8, 8)
	if n == 0 {
		return nil
	}
	out := make([]uint64, n)
	for i := range out {
		out[i] = d.u64(start + 8*i)
	}
	return out
}

func (d *decoder) u32s(at int) []uint32 {
	start, n := d.vec(at, 4, 4)
	if n == 0 {
		return nil
	}
	out := make([]uint32, n)
	for i := range out {
		out[i] = d.u32(start + 4*i)
	}
	return out
}

func (d *decoder) bytes(at int) []byte {
	start, n := d.vec(at, 1, 1)
	if n == 0 {
		return nil
	}
	return append([]byte(nil), d.b[start:start+n]...)
}
