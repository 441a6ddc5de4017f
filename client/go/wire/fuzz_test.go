package wire

import (
	"bytes"
	"testing"
)

// FuzzDecode drives the decoder with arbitrary streams: it never panics, and whatever
// it reads as a message encodes to a frame that reads back to the same bytes. The seed corpus
// (every shared vector and check) runs in every go test.
func FuzzDecode(f *testing.F) {
	frames, checks := readVectors(f)
	for _, v := range frames {
		f.Add(v.bytes)
	}
	for _, c := range checks {
		f.Add(c.bytes)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		_, _ = ValidateStream(b, DefaultMaxFrame)
		fr, ok, err := SplitFrame(b, DefaultMaxFrame)
		if err != nil || !ok {
			return
		}
		m, err := fr.Message()
		if err != nil {
			return
		}
		again, err := AppendVersion(nil, m, fr.Header.Version, fr.Header.RequestID, fr.Header.Flags)
		if err != nil {
			t.Fatalf("a decoded %v does not encode: %v", fr.Header.Kind, err)
		}
		fr2, ok, err := SplitFrame(again, DefaultMaxFrame)
		if err != nil || !ok {
			t.Fatalf("re-encoded %v does not split: %v", fr.Header.Kind, err)
		}
		back, err := fr2.Message()
		if err != nil {
			t.Fatalf("re-encoded %v does not decode: %v", fr.Header.Kind, err)
		}
		// Bytes, not values: a NaN weight is not equal to itself.
		twice, _ := AppendVersion(nil, back, fr.Header.Version, fr.Header.RequestID, fr.Header.Flags)
		if !bytes.Equal(twice, again) {
			t.Fatalf("%v changed in a round trip: %+v then %+v", fr.Header.Kind, m, back)
		}
	})
}
