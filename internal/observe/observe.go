// Package observe is the one copy of what the packages' metrics share: a package's meter, taken
// from the MeterProvider its config names, its instruments created with their errors logged, and
// the attribute sets of its measurements, each built once.
package observe

import (
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"
)

// Meter is one package's meter and the attribute sets of its measurements.
type Meter struct {
	metric.Meter
	// Given reports that the config named a MeterProvider (a package may then skip the work of
	// measurements that a no-op provider would drop).
	Given bool

	sets  sync.Map // key -> Options
	nsets atomic.Int32
}

// Fallback is the MeterProvider a package uses when its config names none.
type Fallback int

const (
	// Global is otel.GetMeterProvider(): a no-op until the application sets one.
	Global Fallback = iota
	// NoOp records nothing.
	NoOp
)

// New returns the meter named name of mp, or of fallback's provider when mp is nil.
func New(mp metric.MeterProvider, fallback Fallback, name string) *Meter {
	m := &Meter{Given: mp != nil}
	switch {
	case mp != nil:
	case fallback == NoOp:
		mp = noop.NewMeterProvider()
	default:
		mp = otel.GetMeterProvider()
	}
	m.Meter = mp.Meter(name)
	return m
}

// Created logs the errors of creating instruments as a warning of pkg ("ratelimit"). The API
// returns a working no-op instrument along with any error (an invalid name, which the packages'
// constants are not), so an error is only logged.
func Created(log *slog.Logger, pkg string, errs ...error) {
	if err := errors.Join(errs...); err != nil {
		log.Warn(pkg+": creating metric instruments", "error", err)
	}
}

// Options are the options of a measurement with one attribute set, as the instruments' methods
// take them, so that passing them allocates nothing.
type Options struct {
	Add    []metric.AddOption
	Record []metric.RecordOption
}

// maxSets bounds the attribute sets a Meter keeps (they are few: a package's calls × outcomes ×
// configured names); past it, sets are built per measurement.
const maxSets = 4096

// Attrs returns the options of the attribute set kvs builds, built once per key (a comparable
// value that names the set).
func (m *Meter) Attrs(key any, kvs func() []attribute.KeyValue) Options {
	if v, ok := m.sets.Load(key); ok {
		return v.(Options)
	}
	opt := metric.WithAttributeSet(attribute.NewSet(kvs()...))
	o := Options{Add: []metric.AddOption{opt}, Record: []metric.RecordOption{opt}}
	if m.nsets.Load() < maxSets {
		if v, loaded := m.sets.LoadOrStore(key, o); loaded {
			return v.(Options)
		}
		m.nsets.Add(1)
	}
	return o
}
