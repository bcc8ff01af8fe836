// Package markdown reads the project's Markdown documentation for the tests that keep it true:
// a page's sections by heading, the rows of its tables, its fenced code blocks and the example
// comments before them. Only tests import it.
package markdown

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

// Root is the repository's root (testutil.RepoRoot).
func Root() (string, error) { return testutil.RepoRoot() }

// Read returns the page at path, relative to the repository's root ("docs/reference.md").
func Read(path string) (string, error) {
	root, err := Root()
	if err != nil {
		return "", err
	}
	b, err := os.ReadFile(filepath.Join(root, path))
	return string(b), err
}

// Section returns the text under heading, a whole heading line ("## Metrics"), up to the next
// heading of the same or a higher level; false when the page has no such heading. Lines inside
// fenced code blocks are never headings.
func Section(page, heading string) (string, bool) {
	level := strings.IndexFunc(heading, func(r rune) bool { return r != '#' })
	lines := strings.Split(page, "\n")
	start := -1
	fenced := false
	for i, l := range lines {
		if strings.HasPrefix(l, "```") {
			fenced = !fenced
		}
		if fenced {
			continue
		}
		if start < 0 {
			if l == heading {
				start = i + 1
			}
			continue
		}
		if n := headingLevel(l); n > 0 && n <= level {
			return strings.Join(lines[start:i], "\n"), true
		}
	}
	if start < 0 {
		return "", false
	}
	return strings.Join(lines[start:], "\n"), true
}

// headingLevel is the number of #s of a heading line, 0 for any other line.
func headingLevel(l string) int {
	n := strings.IndexFunc(l, func(r rune) bool { return r != '#' })
	if n <= 0 || !strings.HasPrefix(l[n:], " ") {
		return 0
	}
	return n
}

// Headings returns every heading line of the page, outside code blocks.
func Headings(page string) []string {
	var out []string
	fenced := false
	for _, l := range strings.Split(page, "\n") {
		if strings.HasPrefix(l, "```") {
			fenced = !fenced
		}
		if !fenced && headingLevel(l) > 0 {
			out = append(out, l)
		}
	}
	return out
}

// Anchor is the link target GitHub gives a heading: "## Uplinks: every device" is
// "uplinks-every-device".
func Anchor(heading string) string {
	text := strings.TrimSpace(strings.TrimLeft(heading, "#"))
	var b strings.Builder
	for _, r := range strings.ToLower(text) {
		switch {
		case r == ' ':
			b.WriteByte('-')
		case r == '-' || r == '_' || r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r > 127:
			b.WriteRune(r)
		}
	}
	return b.String()
}

// Rows returns the body rows of every table in text, each as its cells, trimmed and with
// escaped pipes ("\|") unescaped; header rows and separator rows are left out.
func Rows(text string) [][]string {
	var rows [][]string
	lines := strings.Split(text, "\n")
	for i, l := range lines {
		if !strings.HasPrefix(l, "|") {
			continue
		}
		if isSeparator(l) || i+1 < len(lines) && isSeparator(lines[i+1]) {
			continue
		}
		rows = append(rows, Cells(l))
	}
	return rows
}

func isSeparator(l string) bool {
	return strings.HasPrefix(l, "|") && strings.Trim(l, "|-: ") == ""
}

// Cells splits one table row into its cells.
func Cells(row string) []string {
	row = strings.TrimSpace(row)
	row = strings.TrimPrefix(strings.TrimSuffix(row, "|"), "|")
	var cells []string
	var cur strings.Builder
	for i := 0; i < len(row); i++ {
		switch {
		case row[i] == '\\' && i+1 < len(row) && row[i+1] == '|':
			cur.WriteByte('|')
			i++
		case row[i] == '|':
			cells = append(cells, strings.TrimSpace(cur.String()))
			cur.Reset()
		default:
			cur.WriteByte(row[i])
		}
	}
	return append(cells, strings.TrimSpace(cur.String()))
}

// CodeSpans returns the text of each `code span` in s.
func CodeSpans(s string) []string {
	parts := strings.Split(s, "`")
	var out []string
	for i := 1; i < len(parts); i += 2 {
		out = append(out, parts[i])
	}
	return out
}

// Block is a fenced code block.
type Block struct {
	Line int    // of its opening fence, counting from 1
	Lang string // the fence's info string: "yaml", "sh", or empty
	Body string // its lines, without the fences
	// Example is what the HTML comment on the line right above the fence says after
	// "example:" (<!-- example: above -->), empty without one.
	Example string
}

// Blocks returns the page's fenced code blocks, in order.
func Blocks(page string) ([]Block, error) {
	var out []Block
	var cur *Block
	var body []string
	lines := strings.Split(page, "\n")
	for i, l := range lines {
		switch {
		case cur == nil && strings.HasPrefix(l, "```"):
			cur = &Block{Line: i + 1, Lang: strings.TrimSpace(strings.TrimPrefix(l, "```"))}
			if i > 0 {
				cur.Example = exampleComment(lines[i-1])
			}
			body = nil
		case cur != nil && strings.TrimSpace(l) == "```":
			cur.Body = strings.Join(body, "\n")
			out = append(out, *cur)
			cur = nil
		case cur != nil:
			body = append(body, l)
		}
	}
	if cur != nil {
		return out, fmt.Errorf("line %d: a code block that never ends", cur.Line)
	}
	return out, nil
}

func exampleComment(l string) string {
	l = strings.TrimSpace(l)
	if !strings.HasPrefix(l, "<!--") || !strings.HasSuffix(l, "-->") {
		return ""
	}
	l = strings.TrimSpace(strings.TrimSuffix(strings.TrimPrefix(l, "<!--"), "-->"))
	rest, ok := strings.CutPrefix(l, "example:")
	if !ok {
		return ""
	}
	return strings.TrimSpace(rest)
}
