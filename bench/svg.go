package main

import (
	"fmt"
	"html"
	"math"
	"strings"
)

// palette colours contenders by ID.
var palette = map[string]string{
	"txlimit":         "#1f77b4",
	"txlimit-batched": "#ff7f0e",
	"txlimit-ser":     "#17becf",
	"redis-lua":       "#d62728",
	"floor":           "#e377c2",
	"naive-ser":       "#8c564b",
	"x-time-rate":     "#7f7f7f",
	"txlimit-16":      "#2ca02c",
	"txlimit-16-ser":  "#9467bd",
}

// SVG draws decisions/s against callers for the allow-heavy mix: hot key and per user side by side,
// one line per contender, log scales on both axes.
func (rep *Report) SVG() string {
	const (
		width, height = 980, 580
		panelW        = 400
		panelH        = 330
		top           = 86
		left1, left2  = 80, 560
	)
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, r := range rep.Results {
		if r.Cell.Limit.Name != limitAllow.Name || r.PerSecond() <= 0 {
			continue
		}
		lo, hi = math.Min(lo, r.PerSecond()), math.Max(hi, r.PerSecond())
	}
	if math.IsInf(lo, 0) {
		lo, hi = 1, 10
	}
	dLo, dHi := math.Floor(math.Log10(lo)), math.Ceil(math.Log10(hi))
	if dHi <= dLo {
		dHi = dLo + 1
	}
	xMax := math.Log2(float64(callerCounts[len(callerCounts)-1]))
	xOf := func(left float64, callers int) float64 {
		return left + 20 + (panelW-40)*math.Log2(float64(callers))/xMax
	}
	yOf := func(v float64) float64 { return top + panelH - panelH*(math.Log10(v)-dLo)/(dHi-dLo) }

	var b strings.Builder
	w := func(format string, a ...any) { fmt.Fprintf(&b, format, a...) }
	w(`<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="Helvetica, Arial, sans-serif" font-size="12">`+"\n", width, height, width, height)
	w(`<rect width="100%%" height="100%%" fill="white"/>` + "\n")
	w(`<text x="%d" y="28" font-size="17" font-weight="bold" text-anchor="middle">Rate-limit decisions per second vs concurrent callers (allow-heavy mix)</text>`+"\n", width/2)
	w(`<text x="%d" y="48" fill="#555" text-anchor="middle">%s mode, %s; %s</text>`+"\n", width/2, rep.Mode.Name,
		rep.Started.UTC().Format("2006-01-02"), html.EscapeString(firstOr(rep.Machine, "")))

	for pi, sc := range []Scenario{HotKey, PerUser} {
		left := float64(left1)
		if pi == 1 {
			left = left2
		}
		title := "Hot key: every caller on one key"
		if sc == PerUser {
			title = "Per user: one key per caller"
		}
		w(`<text x="%.0f" y="%d" font-size="14" font-weight="bold" text-anchor="middle">%s</text>`+"\n", left+panelW/2, top-8, title)
		w(`<rect x="%.0f" y="%d" width="%d" height="%d" fill="none" stroke="#999"/>`+"\n", left, top, panelW, panelH)
		for d := dLo; d <= dHi; d++ {
			y := yOf(math.Pow(10, d))
			w(`<line x1="%.0f" y1="%.1f" x2="%.0f" y2="%.1f" stroke="#e3e3e3"/>`+"\n", left, y, left+panelW, y)
			w(`<text x="%.0f" y="%.1f" text-anchor="end" fill="#444">%s</text>`+"\n", left-6, y+4, decade(d))
		}
		for _, n := range callerCounts {
			x := xOf(left, n)
			w(`<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#e3e3e3"/>`+"\n", x, top, x, top+panelH)
			w(`<text x="%.1f" y="%d" text-anchor="middle" fill="#444">%d</text>`+"\n", x, top+panelH+16, n)
		}
		w(`<text x="%.0f" y="%d" text-anchor="middle" fill="#444">concurrent callers</text>`+"\n", left+panelW/2, top+panelH+34)
		w(`<text transform="translate(%.0f %d) rotate(-90)" text-anchor="middle" fill="#444">decisions/s (log scale)</text>`+"\n", left-58, top+panelH/2)

		for _, def := range rep.cellDefs() {
			var pts []string
			for _, n := range callerCounts {
				r := rep.find(def.ID, Cell{sc, limitAllow, n})
				if r == nil || r.PerSecond() <= 0 {
					continue
				}
				pts = append(pts, fmt.Sprintf("%.1f,%.1f", xOf(left, n), yOf(r.PerSecond())))
			}
			if len(pts) == 0 {
				continue
			}
			col, dash, sw := colour(def), "", 2.5
			if def.Family != FamilyTxlimit {
				dash, sw = ` stroke-dasharray="6 4"`, 2
			}
			w(`<polyline points="%s" fill="none" stroke="%s" stroke-width="%.1f"%s/>`+"\n", strings.Join(pts, " "), col, sw, dash)
			for _, p := range pts {
				x, y, _ := strings.Cut(p, ",")
				w(`<circle cx="%s" cy="%s" r="3.5" fill="%s"/>`+"\n", x, y, col)
			}
		}
	}

	// Legend: two columns under the panels.
	ly := top + panelH + 62
	for i, def := range rep.cellDefs() {
		x := float64(left1) + float64(i%2)*480
		y := float64(ly + (i/2)*22)
		col := colour(def)
		dash := ""
		if def.Family != FamilyTxlimit {
			dash = ` stroke-dasharray="6 4"`
		}
		w(`<line x1="%.0f" y1="%.0f" x2="%.0f" y2="%.0f" stroke="%s" stroke-width="2.5"%s/>`+"\n", x, y-4, x+30, y-4, col, dash)
		w(`<text x="%.0f" y="%.0f">%s</text>`+"\n", x+38, y, html.EscapeString(def.Name))
	}
	w("</svg>\n")
	return b.String()
}

func colour(d *Def) string {
	if c, ok := palette[d.ID]; ok {
		return c
	}
	return "#bcbd22"
}

func decade(d float64) string {
	switch {
	case d >= 9:
		return fmt.Sprintf("%gG", math.Pow(10, d-9))
	case d >= 6:
		return fmt.Sprintf("%gM", math.Pow(10, d-6))
	case d >= 3:
		return fmt.Sprintf("%gk", math.Pow(10, d-3))
	}
	return fmt.Sprintf("%g", math.Pow(10, d))
}

func firstOr(s []string, def string) string {
	if len(s) == 0 {
		return def
	}
	return s[0]
}
