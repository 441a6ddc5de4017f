package wire

import (
	"encoding/binary"
	"unsafe"

	"github.com/zeebo/xxh3"
)

// littleEndian: this machine stores a uint32 as its little-endian bytes.
var littleEndian = func() bool {
	x := uint32(1)
	return *(*byte)(unsafe.Pointer(&x)) == 1
}()

// ChainHashVersion is the chain hash's own version (docs/protocol.md §5.2).
const ChainHashVersion = 1

// BlockUnits is the keyspace's block size: tokenBlock tokens, or ByteChunk bytes.
func (k Keyspace) BlockUnits(tokenBlock uint32) uint32 {
	if k.Kind == ChunkBytes {
		return ByteChunk
	}
	return tokenBlock
}

// Seed is the keyspace's hash, which block 0 of its chains is seeded with.
func (k Keyspace) Seed(tokenBlock uint32) uint64 {
	b := make([]byte, 0, 16+12+len(k.Model)+len(k.Lora)+len(k.Salt)+5)
	b = append(b, "kvix-keyspace-v1"...)
	for _, s := range []string{k.Model, k.Lora, k.Salt} {
		b = binary.LittleEndian.AppendUint32(b, uint32(len(s)))
		b = append(b, s...)
	}
	b = append(b, byte(k.Kind))
	b = binary.LittleEndian.AppendUint32(b, k.BlockUnits(tokenBlock))
	return xxh3.Hash(b)
}

// TokenChain is the chain hashes of the whole blocks of tokens, from seed.
func TokenChain(seed uint64, block uint32, tokens []uint32) []uint64 {
	return AppendTokenChain(nil, seed, block, tokens)
}

// AppendTokenChain appends the chain hashes of tokens' whole blocks to out.
func AppendTokenChain(out []uint64, seed uint64, block uint32, tokens []uint32) []uint64 {
	if block == 0 {
		return out
	}
	n := int(block)
	if littleEndian {
		// The token ids' own bytes are their little-endian encoding: hash them in place.
		raw := unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(tokens))), 4*len(tokens))
		prev := seed
		for i := 0; i+4*n <= len(raw); i += 4 * n {
			prev = xxh3.HashSeed(raw[i:i+4*n], prev)
			out = append(out, prev)
		}
		return out
	}
	return appendTokenChainPortable(out, seed, block, tokens)
}

// appendTokenChainPortable encodes each block's token ids before hashing them.
func appendTokenChainPortable(out []uint64, seed uint64, block uint32, tokens []uint32) []uint64 {
	n := int(block)
	scratch := make([]byte, 4*n)
	prev := seed
	for i := 0; i+n <= len(tokens); i += n {
		for j, t := range tokens[i : i+n] {
			binary.LittleEndian.PutUint32(scratch[4*j:], t)
		}
		prev = xxh3.HashSeed(scratch, prev)
		out = append(out, prev)
	}
	return out
}

// ByteChain is the chain hashes of the whole chunks of raw bytes, from seed.
func ByteChain(seed uint64, chunk uint32, bytes []byte) []uint64 {
	if chunk == 0 {
		return nil
	}
	n := int(chunk)
	var out []uint64
	prev := seed
	for i := 0; i+n <= len(bytes); i += n {
		prev = xxh3.HashSeed(bytes[i:i+n], prev)
		out = append(out, prev)
	}
	return out
}

// ExtraKey is a per-block key an engine hashes besides the tokens (docs/protocol.md §5.3).
// Exactly one form is set: a multimodal item (Identifier, Offset), Bytes, Text, or Int.
type ExtraKey struct {
	Form       ExtraForm
	Identifier string
	Offset     int64
	Bytes      []byte
	Text       string
	Int        int64
}

// ExtraForm is an extra key's tag.
type ExtraForm uint8

// The extra key forms, by tag byte.
const (
	ExtraMultimodal ExtraForm = 1
	ExtraBytes      ExtraForm = 2
	ExtraText       ExtraForm = 3
	ExtraInt        ExtraForm = 4
)

const extraDomain uint64 = 0x6b76_6978_6578_7472 // "kvixextr"

// MixExtra mixes keys into a block's hash; a block without keys keeps its hash.
func MixExtra(blockHash uint64, keys []ExtraKey) uint64 {
	if len(keys) == 0 {
		return blockHash
	}
	var b []byte
	withLen := func(p []byte) {
		b = binary.LittleEndian.AppendUint32(b, uint32(len(p)))
		b = append(b, p...)
	}
	for _, k := range keys {
		b = append(b, byte(k.Form))
		switch k.Form {
		case ExtraMultimodal:
			withLen([]byte(k.Identifier))
			b = binary.LittleEndian.AppendUint64(b, uint64(k.Offset))
		case ExtraBytes:
			withLen(k.Bytes)
		case ExtraText:
			withLen([]byte(k.Text))
		case ExtraInt:
			b = binary.LittleEndian.AppendUint64(b, uint64(k.Int))
		}
	}
	return xxh3.HashSeed(b, blockHash^extraDomain)
}

// TokenChainWithExtras is TokenChain with extras[j] (the keys of engine block j, of
// engineBlock tokens) mixed into the first keyspace block of each engine block.
func TokenChainWithExtras(seed uint64, block, engineBlock uint32, tokens []uint32, extras [][]ExtraKey) []uint64 {
	b := max(int(block), 1)
	per := max(int(engineBlock/max(block, 1)), 1)
	out := make([]uint64, 0, len(tokens)/b)
	prev := seed
	for i := 0; (i+1)*b <= len(tokens); i++ {
		h := AppendTokenChain(nil, prev, block, tokens[i*b:(i+1)*b])[0]
		if i%per == 0 && i/per < len(extras) {
			h = MixExtra(h, extras[i/per])
		}
		out = append(out, h)
		prev = h
	}
	return out
}
