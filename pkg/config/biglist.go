package config

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
)

// A 100k-CIDR ConfigMap is one long block sequence of plain CIDRs under a top-level key. The
// YAML library spends most of a Parse on it (a token, an event, a node and an interface{} per
// item, then JSON out and in again): a quarter of a second for 100k. cutBigLists takes such
// sequences out of the document before it goes to the library, and their values are given as
// JSON directly: the library reads the rest, where each sequence is one item, a marker found
// nowhere in the document, and blank lines for the others, so that every line keeps its number
// for the library's messages. Nothing changes what a document means: a sequence is put back only
// where the library read its marker, once in the whole document, as the only item of the key's
// list; any other outcome, an error included, reads the document again whole.

// minBigList is how many items a sequence needs before it is worth taking out: small documents
// go to the library whole.
const minBigList = 256

// bigList is a sequence taken out of a document: the key it belongs to, the marker left in its
// place and its JSON value.
type bigList struct {
	key    string
	marker string
	json   []byte
}

// cutBigLists returns a copy of data with the long CIDR sequences cut out and the sequences, or
// data itself and none.
func cutBigLists(data []byte) ([]byte, []bigList) {
	var (
		out   []byte
		lists []bigList
		done  int // data up to here is in out
	)
	for pos := 0; pos < len(data); {
		line, next := lineAt(data, pos)
		key, ok := emptyRootKey(line)
		if !ok {
			pos = next
			continue
		}
		end, items := listItems(data, next)
		if len(items) < minBigList || !endsSequence(data, end) {
			pos = next
			continue
		}
		l := bigList{key: key, marker: newMarker(data, len(lists)), json: jsonStrings(items)}
		out = append(out, data[done:next]...)
		indent := bytes.IndexByte(data[next:end], '-')
		out = append(out, data[next:next+indent+2]...)
		out = append(out, l.marker...)
		out = append(out, bytes.Repeat([]byte{'\n'}, len(items))...)
		lists = append(lists, l)
		pos, done = end, end
	}
	if lists == nil {
		return data, nil
	}
	return append(out, data[done:]...), lists
}

// newMarker returns the i-th marker of a document: a CIDR-shaped scalar that data lacks.
func newMarker(data []byte, i int) string {
	for n := 0; ; n++ {
		m := fmt.Sprintf("fe:ed::%x:%x/%d", i, n, 1000+n)
		if !bytes.Contains(data, []byte(m)) {
			return m
		}
	}
}

// withBigLists puts the sequences cut out of a document back into its keys, given the JSON the
// library made of the rest, or tells that it cannot: a marker that is not where it should be
// (its key's line was not what it looked like).
func withBigLists(doc map[string]json.RawMessage, js []byte, lists []bigList) bool {
	for _, l := range lists {
		if string(doc[l.key]) != `["`+l.marker+`"]` || bytes.Count(js, []byte(l.marker)) != 1 {
			return false
		}
	}
	for _, l := range lists {
		doc[l.key] = l.json
	}
	return true
}

// lineAt returns the line at pos without its newline, and where the next one starts.
func lineAt(data []byte, pos int) ([]byte, int) {
	if i := bytes.IndexByte(data[pos:], '\n'); i >= 0 {
		return data[pos : pos+i], pos + i + 1
	}
	return data[pos:], len(data)
}

// emptyRootKey tells whether line is "key:" at the first column, with a key of letters and
// digits that starts with a letter (a plain scalar, which may still resolve to something else
// than itself, such as "yes": the caller checks what the key reads as).
func emptyRootKey(line []byte) (string, bool) {
	if len(line) < 2 || line[len(line)-1] != ':' || !isLetter(line[0]) {
		return "", false
	}
	for _, c := range line[1 : len(line)-1] {
		if !isLetter(c) && !isDigit(c) {
			return "", false
		}
	}
	return string(line[:len(line)-1]), true
}

// listItems reads the lines from pos on that are a sequence item of a CIDR-shaped plain scalar,
// all at one indentation, and returns where the first other line starts and the items.
func listItems(data []byte, pos int) (int, [][]byte) {
	var items [][]byte
	indent := -1
	for pos < len(data) {
		line, next := lineAt(data, pos)
		n := 0
		for n < len(line) && line[n] == ' ' {
			n++
		}
		if indent >= 0 && n != indent || len(line) < n+2 || line[n] != '-' || line[n+1] != ' ' ||
			!isCIDRScalar(line[n+2:]) {
			break
		}
		indent = n
		if len(items) == minBigList {
			// A long list, most of its document most likely: room for every line left, rather
			// than growing the slice item by item, which copies it over and over.
			items = append(make([][]byte, 0, len(items)+bytes.Count(data[pos:], []byte{'\n'})+1), items...)
		}
		items = append(items, line[n+2:])
		pos = next
	}
	return pos, items
}

// isCIDRScalar tells whether s is hex digits, dots and colons, then "/" and decimal digits: a
// plain scalar that YAML reads as a string of exactly these bytes (no number, boolean, null or
// timestamp has a "/"; it does not end in ":" and holds no " #", so it is neither a key nor
// followed by a comment), and that needs no escaping in JSON.
func isCIDRScalar(s []byte) bool {
	slash := bytes.IndexByte(s, '/')
	if slash < 1 || slash == len(s)-1 {
		return false
	}
	for _, c := range s[:slash] {
		if !isDigit(c) && !('a' <= c && c <= 'f') && !('A' <= c && c <= 'F') && c != '.' && c != ':' {
			return false
		}
	}
	for _, c := range s[slash+1:] {
		if !isDigit(c) {
			return false
		}
	}
	return true
}

// endsSequence tells whether the line at pos cannot continue the sequence before it or its last
// item: the end of the document, or a line that starts at the first column with something other
// than a space, a tab or a "-" (a more indented line could continue the last item's scalar).
func endsSequence(data []byte, pos int) bool {
	if pos == len(data) {
		return true
	}
	c := data[pos]
	return c != ' ' && c != '\t' && c != '-' && c != '\n' && c != '\r'
}

// jsonStrings is items as a JSON list of strings, as the YAML library would give it.
func jsonStrings(items [][]byte) []byte {
	n := 2
	for _, it := range items {
		n += len(it) + 3
	}
	b := make([]byte, 0, n)
	b = append(b, '[')
	for i, it := range items {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, '"')
		b = append(b, it...)
		b = append(b, '"')
	}
	return append(b, ']')
}

func isLetter(c byte) bool { return 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' }
func isDigit(c byte) bool  { return '0' <= c && c <= '9' }

// plainStrings reads a compact JSON list of strings without escapes or bytes outside printable
// ASCII (a list of CIDRs as the YAML library or jsonStrings writes it) without encoding/json's
// reflection; ok is false for any other JSON, which json.Unmarshal then reads.
func plainStrings(raw []byte) (strs []string, ok bool) {
	if len(raw) < 2 || raw[0] != '[' || raw[len(raw)-1] != ']' {
		return nil, false
	}
	// One string of the whole list, which the items are substrings of: one allocation, not one
	// per item.
	body := string(raw[1 : len(raw)-1])
	strs = make([]string, 0, strings.Count(body, ",")+1)
	for len(body) > 0 {
		if body[0] != '"' {
			return nil, false
		}
		end := 1
		for end < len(body) && body[end] != '"' {
			if c := body[end]; c < 0x20 || c > 0x7e || c == '\\' {
				return nil, false
			}
			end++
		}
		if end == len(body) {
			return nil, false
		}
		strs = append(strs, body[1:end])
		body = body[end+1:]
		if len(body) > 0 {
			if body[0] != ',' || len(body) == 1 {
				return nil, false
			}
			body = body[1:]
		}
	}
	return strs, true
}
